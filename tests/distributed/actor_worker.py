"""Rank bodies for the actor tests. Each runs inside a rank launched by launch_local and
writes what the test checks into a work folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dapo_megatron.actor.batch import PolicyBatch, plan_micro_batches, shard_for_data_parallel
from dapo_megatron.actor.checkpoint import load_checkpoint, load_model_weights, save_checkpoint
from dapo_megatron.actor.megatron_actor import MegatronActor
from dapo_megatron.runtime.distributed import megatron_runtime
from tests.distributed.layout_worker import tiny_config

VOCAB = 128


def actor_config(tp_size, pp_size, dp_size=1, vocab_size=VOCAB, **trainer):
    cfg = tiny_config(tp_size, pp_size, dp_size=dp_size, vocab_size=vocab_size)
    cfg.trainer.lr = trainer.get("lr", 1e-3)
    cfg.trainer.lr_warmup_steps = trainer.get("lr_warmup_steps", 0)
    cfg.trainer.adam_eps = 1e-3  # see layout_worker.ADAM_EPS
    cfg.trainer.weight_decay = 0.0
    cfg.trainer.micro_batch_max_tokens = trainer.get("micro_batch_max_tokens", 64)
    cfg.parallel.use_distributed_optimizer = trainer.get("use_distributed_optimizer", True)
    return cfg


def make_batch(seed: int, response_lengths: list[int], prompt_lengths: list[int] | None = None) -> PolicyBatch:
    """Random tokens, advantages and old log-probs; responses of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(response_lengths)
    prompts = torch.tensor(prompt_lengths or [3 + (i % 4) for i in range(rows)])
    responses = torch.tensor(response_lengths)
    width = int((prompts + responses).max())
    batch = PolicyBatch(
        tokens=torch.randint(0, VOCAB, (rows, width), generator=gen),
        prompt_lengths=prompts,
        response_lengths=responses,
        advantages=torch.randn(rows, generator=gen),
    )
    batch.old_log_probs = (-torch.rand(rows, width, generator=gen) * 2 - 3.0) * batch.response_mask()
    return batch


TINY_HEAD_DIM = {"qwen2": 16, "qwen3": 24, "qwen3_moe": 24}
"""Head width of the tiny models by family: Qwen3's explicit ``head_dim`` is not
hidden / heads (64 / 4 = 16), so a mapping that assumes it would fail."""

TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
)


TINY_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
"""The experts of the tiny mixture-of-experts models: 4 of width 32, top-2, renormalised."""


def set_family(cfg, family: str, ep_size: int = 1, **experts) -> None:
    """Make the tiny actor config's model one of ``family`` (the tiny models' head width,
    and for a family with experts :data:`TINY_EXPERTS`, overridden by ``experts`` in HF
    names, no load-balancing loss, sequence parallelism under TP), split over ``ep_size``
    expert-parallel ranks."""
    from dapo_megatron.families import family_named

    cfg.model.family, cfg.model.head_dim = family, TINY_HEAD_DIM[family]
    cfg.parallel.ep_size = ep_size
    if family_named(family).moe:
        hf = {**TINY_EXPERTS, **experts}
        cfg.model.num_experts, cfg.model.moe_router_topk = hf["num_experts"], hf["num_experts_per_tok"]
        cfg.model.moe_ffn_hidden_size, cfg.model.moe_norm_topk_prob = hf["moe_intermediate_size"], hf["norm_topk_prob"]
        cfg.model.decoder_sparse_step, cfg.model.mlp_only_layers = 1, list(hf.get("mlp_only_layers", []))
        cfg.model.moe_aux_loss_coeff = 0.0
        cfg.parallel.sequence_parallel = cfg.parallel.tp_size > 1  # what an MoE layer under TP needs


def tiny_hf_model(family: str, tied: bool, seed: int, vocab_size: int = 120, **config):
    """A random transformers model of ``family`` with the actor tests' shape (vocabulary
    120: padded to 128; for a family with experts, :data:`TINY_EXPERTS`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dapo_megatron.families import family_named

    if family_named(family).moe:
        config = {**TINY_EXPERTS, **config}
    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(
        family, vocab_size=vocab_size, tie_word_embeddings=tied, head_dim=TINY_HEAD_DIM[family], **TINY_SHAPE, **config
    )
    return AutoModelForCausalLM.from_config(hf_config)


def tiny_hf_qwen2(tied: bool, seed: int, vocab_size: int = 120, **config):
    """:func:`tiny_hf_model` of the Qwen2 family."""
    return tiny_hf_model("qwen2", tied, seed, vocab_size, **config)


def _actor(cfg, info):
    return MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------- layout invariance


def log_probs_at_layout(workdir: str, tp_size: int, pp_size: int) -> None:
    cfg = actor_config(tp_size, pp_size)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = _actor(cfg, info)
        load_model_weights(actor, os.path.join(workdir, "init"))
        batch = make_batch(11, [9, 1, 30, 4, 17])
        log_probs, entropy = actor.compute_log_probs(batch)
        # One DAPO update too: its loss and grad norm must not depend on the layout either.
        update = actor.train(batch)[0]
        if info.rank == 0:
            torch.save(
                {"log_probs": log_probs, "entropy": entropy, "loss": update.loss, "grad_norm": update.grad_norm},
                os.path.join(workdir, f"lp_tp{tp_size}_pp{pp_size}.pt"),
            )
        if tp_size > 1 and pp_size == 1:
            _vocab_parallel_against_reference(workdir, info)


def _vocab_parallel_against_reference(workdir: str, info) -> None:
    """The TP-split function against float64 log_softmax on the gathered logits."""
    from megatron.core import parallel_state

    from dapo_megatron.actor.vocab_parallel import vocab_parallel_log_probs_and_entropy

    group = parallel_state.get_tensor_model_parallel_group()
    tp, rank = group.size(), info.tp_rank
    gen = torch.Generator().manual_seed(3)
    vocab, padded, hidden_size, tokens = 90, 96, 16, 21  # 6 padded rows on the last shard
    hidden = torch.randn(tokens, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(padded, hidden_size, generator=gen, dtype=torch.float64) * 0.5
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    g_lp, g_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    shard = padded // tp
    h = hidden.float().requires_grad_(True)
    w = weight[rank * shard : (rank + 1) * shard].float().clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs_and_entropy(
        h, w, targets, vocab_size=vocab, vocab_start=rank * shard, group=group, chunk_tokens=8
    )
    (lp * g_lp + ent * g_ent).sum().backward()
    grad_hidden = h.grad.clone()
    torch.distributed.all_reduce(grad_hidden, group=group)  # what the TP input mapping does

    h64, w64 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    log_softmax = torch.log_softmax((h64 @ w64.t())[:, :vocab], dim=-1)
    ref_lp = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_softmax.exp() * log_softmax).sum(-1)
    (ref_lp * g_lp.double() + ref_ent * g_ent.double()).sum().backward()

    def rel(a, b):
        return float((a.double() - b).abs().max() / b.abs().max())

    _write_json(
        Path(workdir, f"vocab_reference_rank{rank}.json"),
        {
            "log_probs": rel(lp.detach(), ref_lp.detach()),
            "entropy": rel(ent.detach(), ref_ent.detach()),
            "grad_hidden": rel(grad_hidden, h64.grad),
            "grad_weight": rel(w.grad, w64.grad[rank * shard : (rank + 1) * shard]),
            "padded_grad_nonzero": int(torch.count_nonzero(w.grad[max(0, vocab - rank * shard) :])),
        },
    )


# ---------------------------------------------------------------- data-parallel exactness

DP_RESPONSES = [1, 25, 2, 30, 3, 20, 2, 28]  # very different lengths
DP_PROMPTS = [3, 4, 3, 5, 4, 3, 6, 3]
DP_BUDGET = 69  # with dp=2 this packs each rank's 4 rows into 2 micro-batches


def _capture_gradients(actor):
    """Make optimizer.step() record the finished gradients and skip the update."""
    captured = []

    def step():
        captured.append({name: p.main_grad.detach().clone() for name, p in actor.gpt.named_parameters()})
        return True, 0.0, None

    actor.optimizer.step = step
    return captured


def dp_gradients(workdir: str, dp_size: int) -> None:
    cfg = actor_config(1, 1, dp_size=dp_size, micro_batch_max_tokens=DP_BUDGET, use_distributed_optimizer=False)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = _actor(cfg, info)
        load_model_weights(actor, os.path.join(workdir, "init"))
        captured = _capture_gradients(actor)
        batch = make_batch(5, DP_RESPONSES, DP_PROMPTS)
        local = shard_for_data_parallel(batch, info.dp_rank, dp_size)
        metrics = actor.train(local)
        if dp_size > 1:
            if info.rank == 0:
                torch.save(captured[0], os.path.join(workdir, "grads_dp2.pt"))
                _write_json(Path(workdir, "dp2_metrics.json"), metrics[0].as_dict())
            return
        # One rank: the whole mini-batch, and the pieces the wrong normalisations would use.
        grads = {"full": captured[0], "ranks": [], "micro_batches": []}
        for rank in range(2):
            piece = shard_for_data_parallel(batch, rank, 2)
            actor.train(piece)
            grads["ranks"].append(captured[-1])
            lengths = piece.seq_lengths.tolist()
            for rows in plan_micro_batches(lengths, DP_BUDGET):
                actor.train(piece.select(rows))
                grads["micro_batches"].append(captured[-1])
        torch.save(grads, os.path.join(workdir, "grads_dp1.pt"))


# ---------------------------------------------------------------- training and resume

RESUME_RESPONSES = [6, 14, 3, 9, 12, 5, 8, 2]


def _train_steps(actor, batch, steps, losses):
    for _ in range(steps):
        metrics = actor.train(batch, num_mini_batches=2)
        losses.append({"loss": metrics[0].loss, "lr": metrics[0].lr, "grad_norm": metrics[0].grad_norm})


def _resume_batch(vocab_size: int) -> PolicyBatch:
    batch = make_batch(9, RESUME_RESPONSES)
    batch.tokens = batch.tokens % vocab_size
    return batch


def train_and_save(workdir: str, tp_size: int, pp_size: int, vocab_size: int = VOCAB) -> None:
    """Three steps, checkpoint, a fourth step; losses and the final weights to files."""
    cfg = actor_config(tp_size, pp_size, vocab_size=vocab_size, lr=5e-3, lr_warmup_steps=5)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = _actor(cfg, info)
        load_model_weights(actor, os.path.join(workdir, "init"))
        batch = _resume_batch(vocab_size)
        # The sampling policy's log-probs: the initial weights', fixed for every step.
        batch.old_log_probs, _ = actor.compute_log_probs(batch)
        if info.rank == 0:
            torch.save(batch.old_log_probs, os.path.join(workdir, "old_log_probs.pt"))
        losses = []
        _train_steps(actor, batch, 3, losses)
        save_checkpoint(actor, os.path.join(workdir, "ckpt"), keep_last=2)
        _train_steps(actor, batch, 1, losses)
        _save_weights(actor, os.path.join(workdir, "final_uninterrupted"))
        if info.rank == 0:
            _write_json(Path(workdir, "losses_uninterrupted.json"), losses)


def resume_and_step(workdir: str, tp_size: int, pp_size: int, vocab_size: int = VOCAB) -> None:
    cfg = actor_config(tp_size, pp_size, vocab_size=vocab_size, lr=5e-3, lr_warmup_steps=5)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = _actor(cfg, info)
        step = load_checkpoint(actor, os.path.join(workdir, "ckpt"), seed=cfg.trainer.seed)
        batch = _resume_batch(vocab_size)
        batch.old_log_probs = torch.load(os.path.join(workdir, "old_log_probs.pt"))
        losses = []
        _train_steps(actor, batch, 1, losses)
        _save_weights(actor, os.path.join(workdir, "final_resumed"))
        if info.rank == 0:
            _write_json(Path(workdir, "losses_resumed.json"), {"step": step, "losses": losses})


def _save_weights(actor, path: str) -> None:
    from dapo_megatron.actor.checkpoint import save_dist_checkpoint

    os.makedirs(path, exist_ok=True)
    save_dist_checkpoint(actor.gpt.sharded_state_dict(prefix=""), path)


# ---------------------------------------------------------------- fused path vs megatron's own output layer


def fused_against_megatron_logits(workdir: str, tied: bool) -> None:
    """The actor's log-probs/entropy against log_softmax of GPTModel's own logits (float64)."""
    from dapo_megatron.models.gpt import build_model

    cfg = actor_config(1, 1)
    cfg.model.tie_word_embeddings = tied
    cfg.model.vocab_size = 120  # padded to 128 by megatron: 8 rows that must never count
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        plain = build_model(cfg.model, cfg.parallel, "cpu", output_logits=True)
        actor = _actor(cfg, info)
        actor.gpt.load_state_dict(plain.state_dict())
        batch = make_batch(4, [5, 12, 1, 8])
        batch.tokens = batch.tokens % 120
        log_probs, entropy = actor.compute_log_probs(batch)
        with torch.no_grad():
            logits = plain(batch.tokens, torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens), None)
        logits = logits.double()[..., :120]  # megatron's padded columns are not vocabulary
        log_softmax = torch.log_softmax(logits[:, :-1], dim=-1)
        ref_lp = torch.nn.functional.pad(log_softmax.gather(-1, batch.tokens[:, 1:].unsqueeze(-1)).squeeze(-1), (1, 0))
        ref_ent = torch.nn.functional.pad(-(log_softmax.exp() * log_softmax).sum(-1), (1, 0))
        mask = batch.response_mask().bool()
        _write_json(
            Path(workdir, f"fused_vs_megatron_tied{int(tied)}.json"),
            {
                "log_probs": float((log_probs.double() - ref_lp)[mask].abs().max()),
                "entropy": float((entropy.double() - ref_ent)[mask].abs().max()),
                "num_tokens": int(mask.sum()),
            },
        )


# ---------------------------------------------------------------- weight sync to the rollout engine

SYNC_PROMPTS = [[5, 17, 99, 3], [42, 8], [120, 64, 1, 2, 77]]
SYNC_BUCKET_BYTES = 48 * 1024  # small, so the tiny model travels in many buckets


def _sampled_batch(rows: list[tuple[list[int], list[int], list[float]]]) -> tuple[PolicyBatch, torch.Tensor]:
    """The engine's samples ``(prompt, response, log-probs)`` as a batch, and the engine's
    log-probs on its label grid."""
    width = max(len(p) + len(r) for p, r, _ in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    engine_lp = torch.zeros(len(rows), width)
    for i, (prompt, response, lps) in enumerate(rows):
        tokens[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        engine_lp[i, len(prompt) : len(prompt) + len(response)] = torch.tensor(lps)
    batch = PolicyBatch(
        tokens=tokens,
        prompt_lengths=torch.tensor([len(p) for p, _, _ in rows]),
        response_lengths=torch.tensor([len(r) for _, r, _ in rows]),
    )
    return batch, engine_lp


def sync_generate_train(workdir: str, tp_size: int, pp_size: int) -> None:
    """Sync to a transformers engine, generate, compare log-probs, train, sync again."""
    from dapo_megatron.algo.metrics import rollout_consistency
    from dapo_megatron.rollout.engine import SamplingParams
    from dapo_megatron.rollout.hf_engine import HFRolloutEngine
    from dapo_megatron.weight_sync.gather import sync_weights

    cfg = actor_config(tp_size, pp_size, lr=1e-2)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = _actor(cfg, info)
        load_model_weights(actor, os.path.join(workdir, "init"))
        engine = HFRolloutEngine.from_model_config(cfg.model) if info.rank == 0 else None
        stats = sync_weights(actor, engine, bucket_bytes=SYNC_BUCKET_BYTES)
        _save_weights(actor, os.path.join(workdir, "actor_1"))
        samples = [None]
        if info.rank == 0:
            torch.save(engine.state_dict(), os.path.join(workdir, "engine_1.pt"))
            greedy = engine.generate(SYNC_PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
            torch.save([g.token_ids for g in greedy], os.path.join(workdir, "greedy.pt"))
            sampled = engine.generate(SYNC_PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, seed=1), n=2)
            samples = [[(SYNC_PROMPTS[g.prompt_index], g.token_ids, g.log_probs) for g in sampled]]
            _write_json(
                Path(workdir, "sync_1.json"),
                {
                    "num_buckets": stats.num_buckets,
                    "num_bytes": stats.num_bytes,
                    "num_tensors": stats.num_tensors,
                    "seconds": stats.seconds,
                },
            )
        torch.distributed.broadcast_object_list(samples, src=0)
        batch, engine_lp = _sampled_batch(samples[0])
        batch.advantages = torch.tensor([1.0, -1.0] * (batch.num_rows // 2))
        actor_lp, _ = actor.compute_log_probs(batch)
        consistency = rollout_consistency(actor_lp, engine_lp, batch.response_mask())
        batch.old_log_probs = actor_lp
        actor.train(batch)
        sync_weights(actor, engine, bucket_bytes=SYNC_BUCKET_BYTES)
        _save_weights(actor, os.path.join(workdir, "actor_2"))
        if info.rank == 0:
            torch.save(engine.state_dict(), os.path.join(workdir, "engine_2.pt"))
            _write_json(
                Path(workdir, "consistency.json"), {**consistency, "num_tokens": int(batch.response_mask().sum())}
            )


def sync_every_rank_feeds(workdir: str) -> None:
    """tp 1 x pp 2 x dp 2: each of the 4 ranks feeds an engine of its own (as on 4 nodes).
    Writes each engine's weights and the bytes each rank sent to other feeders."""
    from dapo_megatron.rollout.hf_engine import HFRolloutEngine
    from dapo_megatron.weight_sync.gather import sync_weights

    cfg = actor_config(1, 2, dp_size=2)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = _actor(cfg, info)
        load_model_weights(actor, os.path.join(workdir, "init"))
        engine = HFRolloutEngine.from_model_config(cfg.model)
        sync_weights(actor, engine, bucket_bytes=SYNC_BUCKET_BYTES, feeders=(0, 1, 2, 3))
        torch.save(engine.state_dict(), os.path.join(workdir, f"engine_of_rank_{info.rank}.pt"))
        _write_json(
            Path(workdir, f"sent_by_rank_{info.rank}.json"),
            {"dp": info.dp_rank, "pp": info.pp_rank, "sent": actor.last_sync_sent_bytes},
        )


# ---------------------------------------------------------------- bf16: sync into a bf16 engine, exact resume


def _main_parameters(actor) -> list[torch.Tensor]:
    """The optimizer's own (main) parameters: the distributed optimizer's shards."""
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    return [p for opt in optimizers for group in opt.optimizer.param_groups for p in group["params"]]


def bf16_sync_train_and_resume(workdir: str, tp_size: int, dp_size: int) -> None:
    """A bf16 actor (``model.params_dtype: bfloat16``) from the fp32 initial checkpoint:
    sync into a bf16 transformers engine (its weights and the actor's HF export saved);
    engine-vs-actor log-probs of sampled responses; three steps, a checkpoint, a fourth
    step; then a new actor resumed from the checkpoint takes the fourth step again."""
    from dapo_megatron.algo.metrics import rollout_consistency
    from dapo_megatron.rollout.engine import SamplingParams
    from dapo_megatron.rollout.hf_engine import HFRolloutEngine
    from dapo_megatron.weight_sync.gather import iter_hf_tensors, sync_weights

    cfg = actor_config(tp_size, 1, dp_size=dp_size, lr=5e-3, lr_warmup_steps=5)
    cfg.model.params_dtype = "bfloat16"
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = _actor(cfg, info)
        load_model_weights(actor, os.path.join(workdir, "init"))
        engine = HFRolloutEngine.from_model_config(cfg.model, dtype=torch.bfloat16) if info.rank == 0 else None
        sync_weights(actor, engine, bucket_bytes=SYNC_BUCKET_BYTES)
        exported = {name: tensor.clone() for name, tensor in iter_hf_tensors(actor)}
        samples = [None]
        if info.rank == 0:
            torch.save({"engine": engine.state_dict(), "actor": exported}, os.path.join(workdir, "bf16_sync.pt"))
            sampled = engine.generate(SYNC_PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, seed=1), n=2)
            samples = [[(SYNC_PROMPTS[g.prompt_index], g.token_ids, g.log_probs) for g in sampled]]
        torch.distributed.broadcast_object_list(samples, src=0)
        sampled_batch, engine_lp = _sampled_batch(samples[0])
        actor_lp, _ = actor.compute_log_probs(sampled_batch)
        consistency = rollout_consistency(actor_lp, engine_lp, sampled_batch.response_mask())

        batch = _resume_batch(VOCAB)
        batch.old_log_probs, _ = actor.compute_log_probs(batch)
        shard = shard_for_data_parallel(batch, info.dp_rank, dp_size, 2)
        losses = []
        _train_steps(actor, shard, 3, losses)
        save_checkpoint(actor, os.path.join(workdir, "ckpt_bf16"), keep_last=2)
        _train_steps(actor, shard, 1, losses)
        uninterrupted = [p.detach().clone() for p in actor.gpt.parameters()]
        dtypes = sorted({str(p.dtype) for p in actor.gpt.parameters()})
        main_dtypes = sorted({str(p.dtype) for p in _main_parameters(actor)})

        resumed = _actor(cfg, info)
        step = load_checkpoint(resumed, os.path.join(workdir, "ckpt_bf16"), seed=cfg.trainer.seed)
        # The fp32 main weights came back, not the bf16 weights widened: after three steps
        # they hold bits that bf16 cannot.
        beyond_bf16 = any(bool((p != p.bfloat16().float()).any()) for p in _main_parameters(resumed))
        resumed_losses = []
        _train_steps(resumed, shard, 1, resumed_losses)
        equal = all(torch.equal(a, p) for a, p in zip(uninterrupted, resumed.gpt.parameters()))
        if info.rank == 0:
            _write_json(
                Path(workdir, "bf16_resume.json"),
                {
                    "step": step,
                    "losses": losses,
                    "resumed_losses": resumed_losses,
                    "weights_equal": equal,
                    "main_beyond_bf16": beyond_bf16,
                    "param_dtypes": dtypes,
                    "main_dtypes": main_dtypes,
                    "consistency": {**consistency, "num_tokens": int(sampled_batch.response_mask().sum())},
                },
            )
