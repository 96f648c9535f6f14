"""Rank body for the mixture-of-experts system test: one actor layout loads a checkpoint,
computes log-probs, feeds a transformers engine, trains one step (load-balancing loss
on), feeds it again and saves a trainer checkpoint, writing what the test compares."""

from __future__ import annotations

import os

import torch

from dapo_megatron.actor.batch import shard_for_data_parallel
from dapo_megatron.actor.checkpoint import list_checkpoints, load_checkpoint, load_model_weights, save_checkpoint
from dapo_megatron.actor.megatron_actor import MegatronActor
from dapo_megatron.rollout.hf_engine import HFRolloutEngine
from dapo_megatron.runtime.distributed import megatron_runtime
from dapo_megatron.weight_sync.gather import sync_weights
from tests.distributed.actor_worker import actor_config, set_family
from tests.distributed.reference_worker import NUM_MINI_BATCHES, VOCAB, old_log_probs_as_trained, reference_batch

AUX_LOSS_COEFF = 0.01


def moe_config(tp_size: int, ep_size: int, dp_size: int):
    cfg = actor_config(tp_size, 1, dp_size=dp_size, vocab_size=VOCAB, micro_batch_max_tokens=24, lr=1e-2)
    set_family(cfg, "qwen3_moe", ep_size)
    cfg.model.moe_aux_loss_coeff = AUX_LOSS_COEFF
    return cfg


def load_sync_train_save(
    workdir: str, tp_size: int, ep_size: int, dp_size: int, source: str, tag: str, save: bool = True
) -> None:
    """``source``: ``mg`` (a converted checkpoint: model weights only) or the name of a
    trainer checkpoint folder (everything restored). Writes ``{tag}.pt`` (log-probs
    before and after the step, the engine's weights after each sync, the step's metrics)
    and, with ``save``, the trainer checkpoint ``ckpt_{tag}`` (named in ``{tag}.pt``)."""
    cfg = moe_config(tp_size, ep_size, dp_size)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
        if source == "mg":
            load_model_weights(actor, os.path.join(workdir, source))
        else:
            load_checkpoint(actor, os.path.join(workdir, source))
        batch = reference_batch()
        batch.old_log_probs = old_log_probs_as_trained(actor, batch, info.dp_rank, dp_size)
        engine = HFRolloutEngine.from_model_config(cfg.model) if info.rank == 0 else None
        sync_weights(actor, engine, bucket_bytes=64 * 1024)
        engine_before = {k: v.clone() for k, v in engine.state_dict().items()} if engine is not None else None
        metrics = actor.train(shard_for_data_parallel(batch, info.dp_rank, dp_size, NUM_MINI_BATCHES), NUM_MINI_BATCHES)
        after = old_log_probs_as_trained(actor, batch, info.dp_rank, dp_size)
        sync_weights(actor, engine, bucket_bytes=64 * 1024)
        if save:
            save_checkpoint(actor, os.path.join(workdir, f"ckpt_{tag}"))
        if info.rank == 0:
            torch.save(
                {
                    "before": batch.old_log_probs,
                    "after": after,
                    "engine_before": engine_before,
                    "engine_after": engine.state_dict(),
                    "metrics": [update.as_dict() for update in metrics],
                    "checkpoint": str(list_checkpoints(os.path.join(workdir, f"ckpt_{tag}"))[-1]) if save else None,
                },
                os.path.join(workdir, f"{tag}.pt"),
            )


def sync_both_ways(workdir: str, family: str, tp_size: int, ep_size: int, dp_size: int) -> None:
    """Load ``hf`` straight from safetensors at a layout and feed two transformers engines
    from it: one by gathered buckets (``sync_weights``, rank 0 feeds), one by every rank's
    own pieces (``iter_piece_buckets``, as colocated CPU engines are fed). Writes both
    engines' weights."""
    import torch.distributed as dist

    from dapo_megatron.actor.checkpoint import load_hf_model_weights
    from dapo_megatron.weight_sync.gather import iter_piece_buckets

    cfg = actor_config(tp_size, 1, dp_size=dp_size, vocab_size=VOCAB, micro_batch_max_tokens=24)
    set_family(cfg, family, ep_size)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
        load_hf_model_weights(actor, os.path.join(workdir, "hf"))
        engine = HFRolloutEngine.from_model_config(cfg.model) if info.rank == 0 else None
        sync_weights(actor, engine, bucket_bytes=64 * 1024)
        # Pieces: every rank's own, gathered on rank 0 as a colocated engine would get them.
        mine = [
            (name, piece.clone(), offset)
            for b in iter_piece_buckets(actor)
            for (name, piece), offset in zip(b.tensors, b.offsets)
        ]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if info.rank == 0:
            from dapo_megatron.weight_sync.bucket import WeightBucket

            by_pieces = HFRolloutEngine.from_model_config(cfg.model)
            by_pieces.begin_weight_update()
            for pieces in everyone:
                bucket = WeightBucket()
                for name, piece, offset in pieces:
                    bucket.tensors.append((name, piece))
                    bucket.offsets.append(offset)
                by_pieces.load_weight_bucket(bucket, False)
            by_pieces.end_weight_update()
            torch.save(
                {"buckets": engine.state_dict(), "pieces": by_pieces.state_dict()},
                os.path.join(workdir, f"sync_{family}.pt"),
            )


ROUTER_PROMPT_LENGTHS = [4, 5, 6, 3, 4, 5] * NUM_MINI_BATCHES
ROUTER_RESPONSE_LENGTHS = [16, 15, 14, 9, 8, 7] * NUM_MINI_BATCHES
"""Sequences of 20, 20, 20, 12, 12, 12 tokens per mini-batch: under a budget of 24,
data-parallel rank 0 gets 20, 20, 12 (three micro-batches) and rank 1 gets 20, 12, 12
(two: 20 | 12 + 12), so rank 1 runs a filler micro-batch last in each update."""


def router_losses_at_pp2(workdir: str, recompute: bool, replay: bool = False) -> None:
    """One DAPO step at pp 2 x dp 2 x ep 2 with the load-balancing loss (0.1) and the
    z-loss (1e-3) on, full activation recompute on or off; with ``replay``, rollout routing
    replay of a random record: each stage's gradients (as the optimizer reads them),
    metrics and micro-batch shapes in ``router_{recompute}_*.pt``."""
    from tests.distributed.actor_worker import make_batch
    from tests.distributed.reference_worker import _step_capturing_gradients, random_routing

    cfg = actor_config(1, 2, dp_size=2, vocab_size=VOCAB, micro_batch_max_tokens=24, lr=1e-2)
    set_family(cfg, "qwen3_moe", 2)
    cfg.model.moe_aux_loss_coeff, cfg.model.moe_z_loss_coeff = 0.1, 1e-3
    cfg.model.recompute_activations = recompute
    cfg.model.routing_replay = "rollout" if replay else "off"
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        batch = make_batch(23, ROUTER_RESPONSE_LENGTHS, ROUTER_PROMPT_LENGTHS)
        batch.tokens %= VOCAB
        if replay:
            random_routing(batch, cfg.model.num_layers, cfg.model.num_experts, cfg.model.moe_router_topk)
        saved = _step_capturing_gradients(cfg, info, workdir, "hf", batch, 2)
        torch.save(saved, os.path.join(workdir, f"router_{recompute}_pp{info.pp_rank}_dp{info.dp_rank}.pt"))
