"""Rank body for the independent-reference test: one DAPO step of the Megatron actor,
with the reduced gradient of every mini-batch captured just before its optimizer step.

The gradient is read where megatron's optimizer reads it (the DDP grad buffer after
``finalize_model_grads``). With the distributed optimizer each data-parallel rank holds
only its reduce-scattered shard of every bucket, so the shards are all-gathered first;
the optimizer reads only its own shard, which is left unchanged. Full tensors are then
mapped to HF names through the converter's mapping (the same one weight sync uses), by
exporting the gradients as if they were the weights.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dapo_megatron.actor.batch import data_parallel_rows, shard_for_data_parallel
from dapo_megatron.actor.checkpoint import load_hf_model_weights, load_reference_weights
from dapo_megatron.actor.megatron_actor import MegatronActor
from dapo_megatron.actor.packing import packed_seq_params
from dapo_megatron.runtime.distributed import megatron_runtime
from dapo_megatron.weight_sync.gather import iter_hf_tensors
from tests.distributed.actor_worker import actor_config, make_batch, set_family

VOCAB = 120
NUM_MINI_BATCHES = 2
RESPONSE_LENGTHS = [9, 3, 12, 5, 5, 11, 2, 7]  # odd token totals: data-parallel shares differ
PROMPT_LENGTHS = [4, 6, 3, 5, 7, 2, 5, 4]


def reference_batch(observed: bool = False):
    """The reference step's batch; ``observed``: as multi-turn episodes' (``rollout.env``),
    each response of at least 5 tokens holds an observation at its 3rd and 4th tokens, in
    the context and out of the loss (the loss mask's holes)."""
    batch = make_batch(21, RESPONSE_LENGTHS, PROMPT_LENGTHS)
    batch.tokens %= VOCAB
    if observed:
        mask = batch.response_mask().clone()
        for row in range(batch.num_rows):
            if batch.response_lengths[row] >= 5:
                start = int(batch.prompt_lengths[row]) + 2
                mask[row, start : start + 2] = 0
        batch.loss_mask = mask
    return batch


def random_routing(batch, moe_layers: int, num_experts: int, topk: int, seed: int = 8) -> None:
    """Give ``batch`` a routing record as an engine would (``model.routing_replay``): every
    position of each row but its last, each MoE layer, ``topk`` distinct experts drawn at
    random (not what any router would pick, so a replay that is ignored cannot pass)."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = batch.tokens.shape
    scores = torch.rand(rows, width, moe_layers, num_experts, generator=gen)
    batch.routed_experts = scores.topk(topk, dim=-1).indices.to(torch.uint8)
    batch.routed_lengths = batch.seq_lengths - 1


def replay_grid(batch) -> torch.Tensor:
    """``[rows, seq, moe_layers, k]`` the experts the actor replays at every position of
    ``batch``'s grid: the record where it covers a row, experts ``0..k-1`` elsewhere."""
    k = batch.routed_experts.shape[-1]
    grid = torch.arange(k).expand(batch.routed_experts.shape).clone()
    for row, covered in enumerate(batch.routed_lengths.tolist()):
        grid[row, :covered] = batch.routed_experts[row, :covered].long()
    return grid


class RowCountDependentGemms(torch.overrides.TorchFunctionMode):
    """A BLAS whose results depend on how many rows a GEMM has, as some CPUs' kernels do
    (an AMD EPYC machine gave old and new log-probs 1.2e-8 apart): every matmul's output
    is scaled by ``1 + 1e-6 * (rows % 7)``. Code whose exactness holds only when the
    kernels happen to be row-independent fails under it."""

    GEMMS = (torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.nn.functional.linear)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.GEMMS and isinstance(out, torch.Tensor) and out.dim() >= 2:
            rows = out.numel() // max(out.shape[-1], 1)
            out = out * (1 + 1e-6 * (rows % 7))
        return out


def old_log_probs_as_trained(actor, batch, dp_rank: int, dp_size: int, reference: bool = False):
    """The whole batch's old log-probs (or, with ``reference``, the KL reference's) as the
    trainer computes them: each data-parallel replica computes its share in the
    micro-batches of its updates; the shares are gathered (each row comes from exactly
    one replica)."""
    rows = data_parallel_rows(batch, dp_rank, dp_size, NUM_MINI_BATCHES)
    log_probs, _ = actor.compute_log_probs(batch.select(rows), num_mini_batches=NUM_MINI_BATCHES, reference=reference)
    full = torch.zeros(batch.tokens.shape)
    full[rows] = log_probs
    dist.all_reduce(full, group=actor.dp_group)
    return full


def _full_gradients_in_buffers(actor) -> None:
    """All-gather every bucket's reduce-scattered shards over the group it was reduced
    over: the data-parallel group, or for experts the expert-data-parallel group."""
    from megatron.core import parallel_state

    _gather_buckets(actor.ddp.buffers, actor.dp_group)
    expert_buffers = getattr(actor.ddp, "expert_parallel_buffers", None) or []
    if expert_buffers:
        _gather_buckets(expert_buffers, parallel_state.get_expert_data_parallel_group())


def _gather_buckets(buffers, group) -> None:
    dp_size = dist.get_world_size(group)
    if dp_size == 1:
        return
    dp_rank = dist.get_rank(group)
    for buffer in buffers:
        for bucket in buffer.buckets:
            data = bucket.grad_data
            shard = data.numel() // dp_size
            assert shard * dp_size == data.numel(), "bucket not padded to the data-parallel size"
            parts = [torch.empty(shard, dtype=data.dtype) for _ in range(dp_size)]
            dist.all_gather(parts, data[dp_rank * shard : (dp_rank + 1) * shard].clone(), group=group)
            data.copy_(torch.cat(parts))


def _hf_named(actor, tensors_of) -> dict[str, torch.Tensor]:
    """This stage's HF tensors (on its tensor-parallel leader) with ``tensors_of(param)``
    in place of each parameter's values."""
    params = list(actor.gpt.parameters())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(tensors_of(p))
        exported = {name: tensor.clone() for name, tensor in iter_hf_tensors(actor)}
        for p, value in zip(params, saved):
            p.copy_(value)
    return exported


def correction_weights_for(batch) -> torch.Tensor:
    """Rollout-correction weights as the trainer makes them: token-level TIS against a
    rollout policy 0.3 nats (s.d.) away, capped at 1.3, with a fifth of the tokens masked
    out (MIS's zeros): values in [0, 1.3], some of them capped."""
    from dapo_megatron.algo.rollout_correction import correction_weights

    gen = torch.Generator().manual_seed(5)
    mask = batch.response_mask()
    rollout = batch.old_log_probs + 0.3 * torch.randn(batch.old_log_probs.shape, generator=gen)
    weights, _ = correction_weights(batch.old_log_probs, rollout, mask, "tis", "token", 1.3)
    return weights * (torch.rand(weights.shape, generator=gen) > 0.2).float()


KL_COEF = 0.5


def dapo_step_with_gradients(
    workdir: str,
    tp_size: int,
    pp_size: int,
    dp_size: int,
    weighted: bool = False,
    row_dependent_gemms: bool = False,
    kl_type: str | None = None,
    family: str = "qwen2",
    ep_size: int = 1,
    mlp_only_layers: tuple[int, ...] = (),
    observed: bool = False,
    replay: bool = False,
) -> None:
    """``row_dependent_gemms``: run the whole step under :class:`RowCountDependentGemms`
    (only the first update's ratio is then checked). ``kl_type``: with the KL penalty of
    that estimator (coefficient ``KL_COEF``) to the reference policy in ``hf_ref_tied*``.
    ``ep_size``: experts over that many expert-parallel ranks (a family with experts);
    ``mlp_only_layers``: its layers that keep a dense MLP; ``observed``: the batch holds
    observation tokens out of the loss (:func:`reference_batch`); ``replay``: rollout routing
    replay of a random routing record (:func:`random_routing`)."""
    if row_dependent_gemms:
        with RowCountDependentGemms():
            return dapo_step_with_gradients(workdir, tp_size, pp_size, dp_size, weighted, family=family)
    cfg = actor_config(tp_size, pp_size, dp_size=dp_size, vocab_size=VOCAB, micro_batch_max_tokens=24, lr=1e-2)
    set_family(cfg, family, ep_size, **({"mlp_only_layers": list(mlp_only_layers)} if mlp_only_layers else {}))
    cfg.parallel.use_distributed_optimizer = True
    if kl_type is not None:
        cfg.algorithm.use_kl_loss, cfg.algorithm.kl_loss_coef, cfg.algorithm.kl_loss_type = True, KL_COEF, kl_type
    if replay:
        cfg.model.routing_replay = "rollout"
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        for tied in (False, True):
            cfg.model.tie_word_embeddings = tied
            batch = reference_batch(observed)
            if replay:
                from dapo_megatron.config import moe_layers

                layers = sum(moe_layers(cfg.model))
                random_routing(batch, layers, cfg.model.num_experts, cfg.model.moe_router_topk)
            saved = _step_capturing_gradients(
                cfg, info, workdir, f"hf_tied{int(tied)}", batch, dp_size, weighted, kl_type
            )
            if info.dp_rank == 0 and info.tp_rank == 0:
                torch.save(saved, os.path.join(workdir, f"ref_tied{int(tied)}_stage{info.pp_rank}.pt"))
            if info.rank == 0:
                torch.save(batch, os.path.join(workdir, f"ref_batch_tied{int(tied)}.pt"))


def _step_capturing_gradients(cfg, info, workdir, hf_folder, batch, dp_size, weighted=False, kl_type=None) -> dict:
    """One rollout step of a new actor on ``hf_folder``'s weights, ``batch`` (given its
    on-policy old log-probs here): what each update's optimizer step saw (full gradients
    under HF names), the weights after it, the metrics, the old log-probs and the shapes of
    the micro-batches of this rank's updates."""
    actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
    load_hf_model_weights(actor, os.path.join(workdir, hf_folder))
    # On-policy: the first update's ratio is exactly 1.
    batch.old_log_probs = old_log_probs_as_trained(actor, batch, info.dp_rank, dp_size)
    if kl_type is not None:
        load_reference_weights(actor, "hf", os.path.join(workdir, hf_folder.replace("hf_", "hf_ref_")))
        batch.ref_log_probs = old_log_probs_as_trained(actor, batch, info.dp_rank, dp_size, reference=True)
    if weighted:
        batch.token_weights = correction_weights_for(batch)
    captured: list[dict[str, torch.Tensor]] = []
    weights_after: list[dict[str, torch.Tensor]] = []
    step = actor.optimizer.step

    def capturing_step():
        _full_gradients_in_buffers(actor)
        captured.append(_hf_named(actor, lambda p: p.main_grad))
        result = step()
        weights_after.append(_hf_named(actor, lambda p: p.detach()))
        return result

    actor.optimizer.step = capturing_step
    shard = shard_for_data_parallel(batch, info.dp_rank, dp_size, NUM_MINI_BATCHES)
    rows = [[mb.rows.tolist() for mb in micro] for micro in actor._update_micro_batches(shard, NUM_MINI_BATCHES)]
    metrics = actor.train(shard, num_mini_batches=NUM_MINI_BATCHES)
    return {
        "gradients": captured,
        "weights_after": weights_after,
        "metrics": [update.as_dict() for update in metrics],
        "old_log_probs": batch.old_log_probs.clone(),
        "row_lengths": [[[int(shard.seq_lengths[i]) for i in mb] for mb in micro] for micro in rows],
    }


PACKED_RESPONSE_LENGTHS = [9, 3, 16, 5, 5, 11, 2, 7]
PACKED_PROMPT_LENGTHS = [4, 6, 4, 5, 7, 2, 5, 4]
"""Sequences of 13, 9, 20, 10 | 12, 13, 7, 11 tokens: under a budget of 24, one data-
parallel rank packs 20 alone, 13 + 10, 9 alone | 13 + 11 (exactly 24) and 12 + 7."""


def packed_batch():
    batch = make_batch(21, PACKED_RESPONSE_LENGTHS, PACKED_PROMPT_LENGTHS)
    batch.tokens %= VOCAB
    return batch


def packed_and_unpacked_steps(
    workdir: str,
    tp_size: int,
    pp_size: int,
    dp_size: int,
    leaky: bool = False,
    device: str = "cpu",
    transformer_impl: str = "local",
    params_dtype: str = "float32",
) -> None:
    """The same rollout step twice from the same weights, with padded rows and with packed
    sequences; with ``leaky``, packed with segments that also let each second sequence
    attend to the one before it in its row (a negative control). ``device``,
    ``transformer_impl`` and ``params_dtype``: the actor's (tests/gpu runs them on CUDA)."""
    from dapo_megatron.actor import packing

    cfg = actor_config(tp_size, pp_size, dp_size=dp_size, vocab_size=VOCAB, micro_batch_max_tokens=24, lr=1e-2)
    cfg.parallel.use_distributed_optimizer = True
    cfg.parallel.device = device
    cfg.model.transformer_impl, cfg.model.params_dtype = transformer_impl, params_dtype
    if leaky:
        packing.packed_seq_params = _leaky_packed_seq_params
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        for pack in (False, True):
            cfg.trainer.pack_sequences = pack
            batch = packed_batch()
            scores = _attention_score_buffers()
            scores.clear()
            saved = _step_capturing_gradients(cfg, info, workdir, "hf_tied0", batch, dp_size)
            # The largest attention-score tensor the step built ([b * heads, sq, sk]).
            saved["attention_scores_numel"] = max((t.numel() for t in scores.values()), default=0)
            if info.dp_rank == 0 and info.tp_rank == 0:
                torch.save(saved, os.path.join(workdir, f"pack{int(pack)}_stage{info.pp_rank}.pt"))
            if info.rank == 0:
                torch.save(batch, os.path.join(workdir, f"pack{int(pack)}_batch.pt"))


def _attention_score_buffers() -> dict:
    """megatron's global memory buffers, where its local attention takes each score tensor
    (grown to the largest asked for)."""
    from megatron.core import parallel_state

    return parallel_state.get_global_memory_buffer().buffer


_PACKED_SEQ_PARAMS = packed_seq_params


def _leaky_packed_seq_params(segments: list[int], device):
    """THD parameters with the row's segments merged two by two: each second sequence
    also attends to the one before it (and takes its RoPE positions after it's)."""
    merged = [sum(segments[i : i + 2]) for i in range(0, len(segments), 2)]
    return _PACKED_SEQ_PARAMS(merged, device)


def moe_log_probs_of_controls(workdir: str, ep_size: int) -> None:
    """Negative controls for the mixture-of-experts reference test: the log-probs of the
    reference batch from the right actor, from one whose router does not renormalise its top-k (the wrong
    ``norm_topk_prob``), and from one loaded with two experts of a layer swapped
    (``hf_swapped``). Each must be far from the float64 reference's."""
    cfg = actor_config(1, 1, dp_size=ep_size, vocab_size=VOCAB, micro_batch_max_tokens=24)
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        out = {}
        for name, folder, norm_topk_prob in (
            ("right", "hf_tied0", True),
            ("wrong_norm_topk_prob", "hf_tied0", False),
            ("swapped", "hf_swapped", True),
        ):
            set_family(cfg, "qwen3_moe", ep_size, norm_topk_prob=norm_topk_prob)
            actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
            load_hf_model_weights(actor, os.path.join(workdir, folder))
            out[name] = old_log_probs_as_trained(actor, reference_batch(), info.dp_rank, ep_size)
        if info.rank == 0:
            torch.save(out, os.path.join(workdir, "controls.pt"))


def qwen3_log_probs_without_qk_norms(workdir: str) -> None:
    """A negative control for the Qwen3 reference test: the reference batch's log-probs
    from the right actor and from one whose q/k norms are left at their initial ones (as a
    mapping that drops HF ``q_norm`` / ``k_norm`` would leave them)."""
    cfg = actor_config(1, 1, vocab_size=VOCAB, micro_batch_max_tokens=24)
    set_family(cfg, "qwen3")
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
        load_hf_model_weights(actor, os.path.join(workdir, "hf_tied0"))
        out = {"right": old_log_probs_as_trained(actor, reference_batch(), 0, 1)}
        with torch.no_grad():
            for name, param in actor.gpt.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    param.fill_(1.0)
        out["without_qk_norms"] = old_log_probs_as_trained(actor, reference_batch(), 0, 1)
        torch.save(out, os.path.join(workdir, "controls.pt"))


def bf16_step(workdir: str, tp_size: int, pp_size: int, dp_size: int) -> None:
    """One rollout step of a bf16 actor (``model.params_dtype: bfloat16``: megatron's
    Float16Module, fp32 main parameters in the distributed optimizer) on the weights in
    ``hf_bf16`` (exactly representable in bf16), captured as :func:`dapo_step_with_gradients` does."""
    cfg = actor_config(tp_size, pp_size, dp_size=dp_size, vocab_size=VOCAB, micro_batch_max_tokens=24, lr=1e-2)
    cfg.model.params_dtype = "bfloat16"
    cfg.parallel.use_distributed_optimizer = True
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        batch = reference_batch()
        saved = _step_capturing_gradients(cfg, info, workdir, "hf_bf16", batch, dp_size)
        if info.dp_rank == 0 and info.tp_rank == 0:
            torch.save(saved, os.path.join(workdir, f"bf16_stage{info.pp_rank}.pt"))
        if info.rank == 0:
            torch.save(batch, os.path.join(workdir, "bf16_batch.pt"))


def transformers_routing(batch, hf_dir: str) -> None:
    """Give ``batch`` the routing record transformers' own model (fp32) makes of each row,
    as the transformers engine records it (``rollout/routed_experts.py``)."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.rollout.routed_experts import RoutingRecorder
    from dapo_megatron.sampling.samples import routing_grid

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    records = []
    for row, length in enumerate(batch.seq_lengths.tolist()):
        recorder = RoutingRecorder(model, 1)
        with recorder, torch.no_grad():
            model(input_ids=batch.tokens[row : row + 1, :length])
        records.append(recorder.columns()[0][: length - 1])
    batch.routed_experts, batch.routed_lengths = routing_grid(records, batch.tokens.shape[1])


def routing_against_a_record(workdir: str) -> None:
    """One DAPO step of a Qwen3-MoE actor on :func:`reference_batch` carrying a routing
    record: transformers' own routing under ``measure`` (``own``), a random one under
    ``measure`` and ``rollout``, and a random one cut short in one row under ``rollout``
    (``short``): each case's update metrics in ``routing_{case}.pt``."""
    from dapo_megatron.config import moe_layers
    from tests.distributed.actor_worker import set_family

    cfg = actor_config(1, 1, vocab_size=VOCAB, micro_batch_max_tokens=24, lr=1e-2)
    set_family(cfg, "qwen3_moe")
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        for case, setting in (("own", "measure"), ("measure", "measure"), ("rollout", "rollout"), ("short", "rollout")):
            cfg.model.routing_replay = setting
            actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
            load_hf_model_weights(actor, os.path.join(workdir, "hf_tied0"))
            batch = reference_batch()
            if case == "own":
                transformers_routing(batch, os.path.join(workdir, "hf_tied0"))
            else:
                random_routing(batch, sum(moe_layers(cfg.model)), cfg.model.num_experts, cfg.model.moe_router_topk)
            if case == "short":
                batch.routed_lengths[0] = batch.prompt_lengths[0] + 1  # two of its response's positions routed
            batch.old_log_probs = old_log_probs_as_trained(actor, batch, 0, 1)
            metrics = actor.train(batch, num_mini_batches=NUM_MINI_BATCHES)
            saved = {"metrics": [update.as_dict() for update in metrics], "batch": batch}
            torch.save(saved, os.path.join(workdir, f"routing_{case}.pt"))
