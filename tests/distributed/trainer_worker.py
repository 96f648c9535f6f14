"""Rank bodies for the trainer-facing actor tests (temperature, weights straight from HF)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dapo_megatron.actor.checkpoint import load_hf_model_weights, load_model_weights
from dapo_megatron.actor.megatron_actor import MegatronActor
from dapo_megatron.runtime.distributed import megatron_runtime
from tests.distributed.actor_worker import actor_config, make_batch


def ratio_at_temperature(workdir: str, tp_size: int, temperature: float) -> None:
    """Old log-probs at ``temperature``; then the first update's ratio, training at the
    same temperature and (negative control) at 1.0."""
    cfg = actor_config(tp_size, 1)
    results = {}
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
        for name, train_temperature in (("control_t1", 1.0), ("same", temperature)):
            load_model_weights(actor, os.path.join(workdir, "init"))
            batch = make_batch(5, [6, 3, 9, 4])
            batch.old_log_probs, _ = actor.compute_log_probs(batch, temperature)
            first = actor.train(batch, num_mini_batches=2, temperature=train_temperature)[0]
            results[name] = {k: getattr(first, k) for k in ("ratio_mean", "ratio_max", "approx_kl", "pg_clipfrac_low")}
    if info.rank == 0:
        Path(workdir, f"temperature_tp{tp_size}.json").write_text(json.dumps(results))


def hf_against_converted(workdir: str, tp_size: int) -> None:
    """Parameters and log-probs after loading the HF folder directly and after loading its
    converted dist checkpoint: they must be identical."""
    cfg = actor_config(tp_size, 1, vocab_size=120)
    cfg.model.tie_word_embeddings = False
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
        batch = make_batch(7, [5, 8, 2])
        batch.tokens %= 120
        load_model_weights(actor, os.path.join(workdir, "converted"))
        converted = {n: p.detach().clone() for n, p in actor.gpt.named_parameters()}
        lp_converted, _ = actor.compute_log_probs(batch)
        with torch.no_grad():
            for p in actor.gpt.parameters():
                p.fill_(0.5)  # so nothing below passes by leftover values
        load_hf_model_weights(actor, os.path.join(workdir, "hf"))
        direct = {n: p.detach().clone() for n, p in actor.gpt.named_parameters()}
        lp_direct, _ = actor.compute_log_probs(batch)
    report = {
        "num_params": len(direct),
        "unequal": [n for n in direct if not torch.equal(direct[n], converted[n])],
        "log_prob_max_diff": float((lp_direct - lp_converted).abs().max()),
        "log_prob_min": float(lp_direct.min()),
    }
    Path(workdir, f"hf_load_tp{tp_size}_rank{info.rank}.json").write_text(json.dumps(report))


def hf_log_probs(workdir: str, tp_size: int, pp_size: int) -> None:
    """Log-probs of a fixed batch after loading the (tied) HF folder directly at (tp, pp)."""
    cfg = actor_config(tp_size, pp_size, vocab_size=120)
    cfg.model.tie_word_embeddings = True
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
        load_hf_model_weights(actor, os.path.join(workdir, "hf_tied"))
        batch = make_batch(7, [5, 8, 2])
        batch.tokens %= 120
        log_probs, _ = actor.compute_log_probs(batch)
    if info.rank == 0:
        torch.save(
            {"tokens": batch.tokens, "mask": batch.response_mask(), "log_probs": log_probs},
            os.path.join(workdir, f"hf_tied_tp{tp_size}_pp{pp_size}.pt"),
        )


def empty_mini_batch(workdir: str) -> None:
    """dp 2: a step whose second mini-batch has no loss tokens equals a step on the first
    mini-batch alone; a bad target id is refused before any state moves."""
    from dapo_megatron.actor.batch import shard_for_data_parallel

    cfg = actor_config(1, 1, dp_size=2)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        full = make_batch(3, [5, 7, 2, 9, 4, 6, 8, 3])
        full.loss_mask = full.response_mask()
        full.loss_mask[4:] = 0  # the second mini-batch: every row filtered out
        first = full.select([0, 1, 2, 3])
        weights, metrics = [], []
        for batch, minis in ((full, 2), (first, 1)):
            actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
            load_model_weights(actor, os.path.join(workdir, "init"))
            metrics.append(actor.train(shard_for_data_parallel(batch, info.dp_rank, 2, minis), minis))
            weights.append({n: p.detach().clone() for n, p in actor.gpt.named_parameters()})
        bad = first.select([0, 1, 2, 3])
        bad.tokens[0, int(bad.prompt_lengths[0])] = 10_000
        step, lr = actor.rollout_step, actor.optimizer.param_groups[0]["lr"]
        try:
            actor.train(shard_for_data_parallel(bad, info.dp_rank, 2, 1), 1)
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        report = {
            "empty": [m.empty for m in metrics[0]],
            "steps": actor.rollout_step,
            "unequal": [n for n in weights[0] if not torch.equal(weights[0][n], weights[1][n])],
            "moved": sum(not torch.equal(weights[0][n], weights[1][n]) for n in weights[0]),
            "loss": [metrics[0][0].loss, metrics[1][0].loss],
            "refused": refused,
            "state_kept": actor.rollout_step == step and actor.optimizer.param_groups[0]["lr"] == lr,
        }
    Path(workdir, f"empty_rank{info.rank}.json").write_text(json.dumps(report))


def nonfinite_update(workdir: str) -> None:
    """dp 2: one rank's loss is not finite (an infinite weight on that rank only). Neither rank
    applies the update; the next, finite update applies on both."""
    from dapo_megatron.actor.batch import shard_for_data_parallel

    cfg = actor_config(1, 1, dp_size=2)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
        load_model_weights(actor, os.path.join(workdir, "init"))
        batch = make_batch(3, [5, 7, 2, 9])
        shard = shard_for_data_parallel(batch, info.dp_rank, 2, 1)
        weight = actor.gpt.decoder.final_layernorm.weight
        original = weight.detach().clone()
        if info.dp_rank == 1:
            with torch.no_grad():
                weight[0] = float("inf")
        before = {n: p.detach().clone() for n, p in actor.gpt.named_parameters()}
        bad = actor.train(shard, 1)[0]
        unchanged = all(torch.equal(p, before[n]) for n, p in actor.gpt.named_parameters())
        with torch.no_grad():
            weight.copy_(original)
        good = actor.train(shard, 1)[0]
        moved = sum(not torch.equal(p, before[n]) for n, p in actor.gpt.named_parameters())
    report = {
        "bad": {k: getattr(bad, k) for k in ("nonfinite", "update_skipped")},
        "bad_loss_finite": bool(torch.isfinite(torch.tensor(bad.loss))),
        "unchanged": unchanged,
        "good": {k: getattr(good, k) for k in ("nonfinite", "update_skipped")},
        "moved": moved,
    }
    Path(workdir, f"nonfinite_rank{info.rank}.json").write_text(json.dumps(report))


def failing_checkpoint_write(workdir: str) -> None:
    """dp 2: the second save fails on rank 0 as a full disk would (its shard file cannot be
    written). Both ranks raise at once, nothing of that save is kept, and the first
    checkpoint stays the latest and loads."""
    import errno
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from dapo_megatron.actor.batch import shard_for_data_parallel
    from dapo_megatron.actor.checkpoint import CheckpointWriteError, load_checkpoint, save_checkpoint

    cfg = actor_config(1, 1, dp_size=2)
    save_dir = os.path.join(workdir, "saves")
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
        load_model_weights(actor, os.path.join(workdir, "init"))
        shard = shard_for_data_parallel(make_batch(3, [5, 7, 2, 9]), info.dp_rank, 2, 1)
        actor.train(shard, 1)
        first = save_checkpoint(actor, save_dir)
        # The save ran in this process: no multiprocessing child (a results Manager) is left.
        children_after_save = [child.name for child in multiprocessing.active_children()]
        saved = {n: p.detach().clone() for n, p in actor.gpt.named_parameters()}
        actor.train(shard, 1)
        if info.rank == 0:

            def full_disk(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            filesystem_async.open = full_disk  # the shard writer's open(), on this rank only
        try:
            save_checkpoint(actor, save_dir)
            error = ""
        except CheckpointWriteError as exc:
            error = str(exc)
        finally:
            vars(filesystem_async).pop("open", None)
        restored_step = load_checkpoint(actor, save_dir)
        restored = all(torch.equal(p, saved[n]) for n, p in actor.gpt.named_parameters())
    report = {
        "error": error,
        "first": first.name,
        "entries": sorted(os.listdir(save_dir)),
        "restored_step": restored_step,
        "restored": restored,
        "children_after_save": children_after_save,
    }
    Path(workdir, f"failing_write_rank{info.rank}.json").write_text(json.dumps(report))
