"""The Megatron actor: Qwen2/Qwen2.5, Qwen3 or Qwen3-MoE at any TP/PP/DP/EP layout; log-probs and DAPO updates.

One instance lives on every rank of the actor. It owns megatron-core's GPTModel (built
with its output layer deferred, so the last stage returns hidden states), megatron's DDP
wrapper, its (distributed) Adam optimizer and LR scheduler, and drives megatron's own
pipeline schedules through ``get_forward_backward_func``.

Exactness of DAPO's token-level mean is the point of this module. Before the
micro-batch loop of a mini-batch, the number of loss tokens of the *whole* mini-batch
(all micro-batches, all data-parallel ranks) is all-reduced once, and every micro-batch
divides its summed token losses by it (``dapo_policy_loss(..., global_num_tokens=...)``).
Megatron's own normalisations are turned off so they cannot change that result:
``calculate_per_token_loss`` stops the schedule from dividing by the number of
micro-batches and makes DDP sum instead of average over data-parallel ranks, and the
grad-finalisation hook is called without a token count so it does not rescale. The
summed gradient is then exactly the gradient of the single-process token mean.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from dapo_megatron.actor import packing
from dapo_megatron.actor.batch import PolicyBatch, plan_micro_batches
from dapo_megatron.actor.update_metrics import LOSS_MEANS, TOKEN_SUMS, UpdateMetrics
from dapo_megatron.actor.vocab_parallel import vocab_parallel_log_probs_and_entropy
from dapo_megatron.algo.loss import dapo_policy_loss
from dapo_megatron.config import AlgorithmConfig, ModelConfig, ParallelConfig, TrainerConfig, padded_vocab_size
from dapo_megatron.config.layout import round_up, sequence_pad_multiple
from dapo_megatron.models.gpt import build_model, output_weight, params_dtype
from dapo_megatron.runtime.distributed import RuntimeInfo

logger = logging.getLogger(__name__)


@dataclass
class _MicroBatch:
    """One micro-batch as the forward step consumes it.

    ``tokens`` is what the model runs: padded rows, one sequence each, or packed rows
    (``actor/packing.py``). The per-token tensors of the loss are on the micro-batch's
    *sequence grid*, one sequence per row in the order of ``rows``; unpacked, that is the
    token grid itself."""

    rows: torch.Tensor  # [n] indices into the mini-batch of the sequences, in grid order
    tokens: torch.Tensor  # [b, L] what the model runs
    position_ids: torch.Tensor  # [b, L]
    loss_mask: torch.Tensor  # [n, W] float, label grid of each sequence
    old_log_probs: Optional[torch.Tensor]  # [n, W]
    advantages: Optional[torch.Tensor]  # [n]
    token_weights: Optional[torch.Tensor] = None  # [n, W] the rollout correction's, or None
    ref_log_probs: Optional[torch.Tensor] = None  # [n, W] the reference policy's (KL penalty), or None
    token_loss_mask: Optional[torch.Tensor] = None  # [b, L] the loss tokens on the token grid (packed only)
    packed_seq_params: object = None  # megatron's PackedSeqParams of a packed row (THD), or None
    padding_mask: Optional[torch.Tensor] = None  # [b, L] bool, MoE: True where the routers' losses must not look
    engine_experts: Optional[torch.Tensor] = None  # [b, L, moe_layers, k] the engine's routing (arange(k) elsewhere)
    engine_routed: Optional[torch.Tensor] = None  # [b, L] bool: the positions the engine routed
    engine_routed_any: bool = False  # whether it routed any (known on the host: no device sync per router)

    @property
    def input_loss_mask(self) -> torch.Tensor:
        """The loss tokens on the token grid (``tokens``'s)."""
        return self.loss_mask if self.token_loss_mask is None else self.token_loss_mask


def _route(routing, index: int, mb: _MicroBatch) -> None:
    """Tell the routers' monitor (``actor/routing.py``) the micro-batch about to run."""
    routing.micro_batch(
        index,
        mb.tokens,
        mb.input_loss_mask,
        filler=mb.rows.numel() == 0,
        engine_experts=mb.engine_experts,
        engine_routed=mb.engine_routed,
        engine_routed_any=mb.engine_routed_any,
    )


class MegatronActor:
    """Policy model of the DAPO trainer on one rank.

    Args:
        model: model section (shape, dtype, layer implementation).
        parallel: layout section; the runtime must already be initialised with it.
        trainer: optimizer, learning rate and micro-batch token budget.
        algorithm: clip ratios and loss aggregation.
        runtime: what :func:`initialize_runtime` returned on this rank.
    """

    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelConfig,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        runtime: RuntimeInfo,
    ) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if parallel.cp_size != 1:
            raise NotImplementedError("parallel.cp_size > 1: context parallelism is not supported by the actor yet")
        self.model_config, self.parallel, self.trainer, self.algorithm = model, parallel, trainer, algorithm
        self.runtime = runtime
        self.device = runtime.device
        self.gpt = build_model(model, parallel, self.device.type, output_logits=False)
        dtype = params_dtype(model, self.device.type)
        self.ddp = DistributedDataParallel(
            self.gpt.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=parallel.use_distributed_optimizer,
                average_in_collective=False,
            ),
            self._mixed_precision(self.gpt),
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=trainer.lr,
                min_lr=0.0,
                weight_decay=trainer.weight_decay,
                adam_beta1=trainer.adam_beta1,
                adam_beta2=trainer.adam_beta2,
                adam_eps=trainer.adam_eps,
                clip_grad=trainer.grad_clip,
                bf16=dtype == torch.bfloat16,
                params_dtype=dtype,
                use_distributed_optimizer=parallel.use_distributed_optimizer,
            ),
            [self.ddp],
        )
        # Linear warm-up over rollout steps, then constant: the scheduler is stepped once
        # per rollout step before its updates, so step k (0-based) trains at
        # lr * min(1, (k + 1) / lr_warmup_steps).
        warmup = trainer.lr_warmup_steps
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if warmup else trainer.lr,
            max_lr=trainer.lr,
            min_lr=0.0,
            lr_warmup_steps=warmup,
            lr_decay_steps=warmup + 1,
            lr_decay_style="constant",
            start_wd=trainer.weight_decay,
            end_wd=trainer.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        config = self.gpt.config
        config.finalize_model_grads_func = self._finalize_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.rollout_step = 0
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        padded = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, parallel.tp_size)
        self.vocab_start = runtime.tp_rank * (padded // parallel.tp_size)
        self.pad_multiple = sequence_pad_multiple(parallel.tp_size, parallel.sequence_parallel, model.fp8)
        # Reused by weight sync for the q/k/v it rearranges into HF layout on every sync.
        self.hf_export_buffers: dict[str, torch.Tensor] = {}
        # The KL penalty's reference policy: the same model, frozen (no gradients, no DDP
        # buffers, no optimizer state), given the run's initial weights by the caller.
        self.reference = self.reference_module = None
        if algorithm.use_kl_loss:
            self.reference = build_model(model, parallel, self.device.type, output_logits=False)
            self.reference.requires_grad_(False)
            self.reference.eval()
            self.reference_module = self._mixed_precision(self.reference)
        # Routing metrics and the load-balancing loss's scale (mixture-of-experts only).
        self.routing = None
        if config.num_moe_experts:
            from dapo_megatron.actor.routing import RoutingMonitor

            self.routing = RoutingMonitor(
                self.gpt, model, self.device, runtime.tp_rank, parallel.tp_size, parallel.sequence_parallel
            )
        # Under rollout routing replay the KL penalty's reference replays the same experts
        # (its log-probs through the experts that sampled the token, as the policy's are).
        self.reference_routing = None
        if self.reference is not None and config.num_moe_experts and model.routing_replay == "rollout":
            from dapo_megatron.actor.routing import RoutingMonitor

            self.reference_routing = RoutingMonitor(
                self.reference, model, self.device, runtime.tp_rank, parallel.tp_size, parallel.sequence_parallel
            )

    # ------------------------------------------------------------------ internals

    def _mixed_precision(self, gpt):
        """``gpt`` as the schedule runs it: under megatron's ``Float16Module`` when its
        parameters are bf16 (bf16 weights and activations, hidden states handed back in
        fp32 by the last stage), as megatron's own training wraps it; as it is in fp32."""
        if gpt.config.bf16:
            from megatron.core.transformer.module import Float16Module

            return Float16Module(gpt.config, gpt)
        return gpt

    @staticmethod
    def _finalize_grads(model, num_tokens=None, **kwargs):
        """megatron's grad finalisation (DP reduce, embedding and norm sync) without its
        per-token rescaling: our losses are already divided by the global token count."""
        from megatron.core.distributed import finalize_model_grads

        return finalize_model_grads(model, num_tokens=None, **kwargs)

    def _micro_batches(self, batch: PolicyBatch) -> list[_MicroBatch]:
        if self.trainer.pack_sequences:
            return self._packed_micro_batches(batch)
        plans = plan_micro_batches(batch.seq_lengths.tolist(), self.trainer.micro_batch_max_tokens, self.pad_multiple)
        mask = batch.response_mask()
        micro = []
        for rows in plans:
            index = torch.tensor(rows, dtype=torch.long)
            width = round_up(int(batch.seq_lengths[index].max()), self.pad_multiple)
            tokens = torch.zeros(len(rows), width, dtype=torch.long)
            used = min(width, batch.tokens.shape[1])
            tokens[:, :used] = batch.tokens[index, :used]
            lengths = batch.seq_lengths[index].tolist()
            micro.append(
                _MicroBatch(
                    tokens=tokens.to(self.device),
                    position_ids=torch.arange(width).expand(len(rows), width).to(self.device),
                    **self._sequence_grids(batch, mask, index, width),
                    **self._router_inputs(batch, [(i, 0, row, lengths[i]) for i, row in enumerate(rows)], tokens.shape),
                )
            )
        return micro

    def _packed_micro_batches(self, batch: PolicyBatch) -> list[_MicroBatch]:
        """One packed row per micro-batch (``actor/packing.py``); the loss tensors on the
        sequence grid, as wide as the longest sequence of the row."""
        lengths = batch.seq_lengths.tolist()
        plans = packing.plan_packed_micro_batches(lengths, self.trainer.micro_batch_max_tokens, self.pad_multiple)
        mask = batch.response_mask()
        micro = []
        for rows in plans:
            index = torch.tensor(rows, dtype=torch.long)
            width = round_up(sum(lengths[i] for i in rows), self.pad_multiple)
            segments = packing.segments_of([lengths[i] for i in rows], width)
            tokens = torch.zeros(1, width, dtype=torch.long)
            token_loss_mask = torch.zeros(1, width)
            start, placements = 0, []
            for i in rows:
                tokens[0, start : start + lengths[i]] = batch.tokens[i, : lengths[i]]
                token_loss_mask[0, start : start + lengths[i]] = mask[i, : lengths[i]]
                placements.append((0, start, i, lengths[i]))
                start += lengths[i]
            micro.append(
                _MicroBatch(
                    tokens=tokens.to(self.device),
                    position_ids=packing.segment_position_ids(segments)[None].to(self.device),
                    token_loss_mask=token_loss_mask.to(self.device),
                    packed_seq_params=packing.packed_seq_params(segments, self.device),
                    **self._sequence_grids(batch, mask, index, max(lengths[i] for i in rows)),
                    **self._router_inputs(batch, placements, tokens.shape),
                )
            )
        return micro

    def _sequence_grids(self, batch: PolicyBatch, mask: torch.Tensor, index: torch.Tensor, width: int) -> dict:
        """The loss tensors of ``batch``'s rows ``index`` (``mask``: the batch's response
        mask), ``width`` columns wide (zeros beyond the batch's own grid), on the actor's
        device."""
        used = min(width, batch.tokens.shape[1])

        def grid(values: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if values is None:
                return None
            out = torch.zeros(len(index), width)
            out[:, :used] = values[index, :used].float()
            return out.to(self.device)

        return {
            "rows": index,
            "loss_mask": grid(mask),
            "old_log_probs": grid(batch.old_log_probs),
            "advantages": batch.advantages[index].float().to(self.device) if batch.advantages is not None else None,
            "token_weights": grid(batch.token_weights),
            "ref_log_probs": grid(batch.ref_log_probs),
        }

    def _router_inputs(self, batch: PolicyBatch, placements: list[tuple[int, int, int, int]], shape) -> dict:
        """What the routers of a mixture-of-experts model take for a micro-batch whose
        token grid has ``shape`` and holds, for each ``(grid row, offset, batch row,
        length)`` of ``placements``, a sequence of ``batch``: the padding mask (True where
        no sequence is; megatron keeps those positions out of the load-balancing loss and
        the z-loss) and, when the batch carries the engine's routing, that routing on the
        grid with the positions it covers. Under ``model.routing_replay: rollout`` the
        positions the engine did not route (a sequence's last token, which it never fed)
        take experts ``0..k-1``, whose output no loss token reads, and are kept out of the
        router losses too. Nothing for a dense model."""
        if self.routing is None:
            return {}
        real = torch.zeros(shape, dtype=torch.bool)
        for row, offset, _, length in placements:
            real[row, offset : offset + length] = True
        out = {"padding_mask": (~real).to(self.device)}
        if batch.routed_experts is None:
            return out
        layers, k = batch.routed_experts.shape[2:]
        experts = torch.arange(k, dtype=batch.routed_experts.dtype).expand(*shape, layers, k).clone()
        routed = torch.zeros(shape, dtype=torch.bool)
        for row, offset, index, length in placements:
            covered = min(int(batch.routed_lengths[index]), length)
            experts[row, offset : offset + covered] = batch.routed_experts[index, :covered]
            routed[row, offset : offset + covered] = True
        routed_any = bool(routed.any())
        if self.model_config.routing_replay == "rollout" and routed_any:
            # (A micro-batch without any routed position keeps its tokens in the losses:
            # megatron's load-balancing loss divides by the count of the others.)
            out["padding_mask"] = (~(real & routed)).to(self.device)
        return {
            **out,
            "engine_experts": experts.to(self.device),
            "engine_routed": routed.to(self.device),
            "engine_routed_any": routed_any,
        }

    def _forward(self, model, mb: _MicroBatch) -> torch.Tensor:
        """``model`` (the wrapped ``gpt``) on ``mb``'s tokens: hidden states ``[b, L, h]``."""
        kwargs = {}
        if mb.packed_seq_params is not None:
            kwargs["packed_seq_params"] = mb.packed_seq_params
        if mb.padding_mask is not None:
            kwargs["padding_mask"] = self._stage_padding_mask(mb.padding_mask)
        return model(mb.tokens, mb.position_ids, None, **kwargs)

    def _stage_padding_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The padding mask as this pipeline stage's routers read it: the first stage's
        GPTModel scatters it over the sequence-parallel ranks itself, later stages
        (megatron 0.16.1) pass it on as given, so they get their part of the sequence."""
        if self.gpt.pre_process or not (self.parallel.sequence_parallel and self.parallel.tp_size > 1):
            return mask
        chunk = mask.shape[1] // self.parallel.tp_size
        rank = self.runtime.tp_rank
        return mask[:, rank * chunk : (rank + 1) * chunk].contiguous()

    def _update_micro_batches(self, batch: PolicyBatch, num_mini_batches: int) -> list[list[_MicroBatch]]:
        """The micro-batches of each of ``batch``'s ``num_mini_batches`` mini-batches, with
        their row indices into ``batch``: exactly what the updates of :meth:`train` run."""
        minis = batch.split(num_mini_batches)
        size = batch.num_rows // num_mini_batches
        planned = []
        for index, mini in enumerate(minis):
            micro = self._micro_batches(mini)
            for mb in micro:
                mb.rows = mb.rows + index * size
            planned.append(micro)
        if self.parallel.ep_size > 1 and dist.get_world_size(self.dp_group) > 1:
            self._pad_to_equal_micro_batch_counts(planned)
        return planned

    def _pad_to_equal_micro_batch_counts(self, planned: list[list[_MicroBatch]]) -> None:
        """Give every data-parallel rank as many micro-batches per mini-batch as the one
        with the most, appending filler ones (one row of padding, no loss token).

        An expert-parallel group may span data-parallel replicas, and every forward of an
        MoE layer is an all-to-all over it: a replica that ran out of micro-batches while
        another still had some would leave it waiting forever. A filler contributes no
        loss token, log-prob or gradient of the policy loss (its tokens are routed, which
        only the load-balancing loss sees)."""
        counts = torch.tensor([len(micro) for micro in planned], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.dp_group)
        width = self.pad_multiple

        def zeros_like_or_none(value):
            return None if value is None else torch.zeros(1, width, device=self.device)

        for micro, target in zip(planned, counts.tolist()):
            template = micro[0]

            while len(micro) < target:
                micro.append(
                    _MicroBatch(
                        rows=torch.zeros(0, dtype=torch.long),
                        tokens=torch.zeros(1, width, dtype=torch.long, device=self.device),
                        position_ids=torch.arange(width, device=self.device).expand(1, width),
                        loss_mask=torch.zeros(1, width, device=self.device),
                        old_log_probs=zeros_like_or_none(template.old_log_probs),
                        advantages=None if template.advantages is None else torch.zeros(1, device=self.device),
                        token_weights=zeros_like_or_none(template.token_weights),
                        ref_log_probs=zeros_like_or_none(template.ref_log_probs),
                    )
                )

    def _log_probs_and_entropy(self, hidden: torch.Tensor, micro: _MicroBatch, temperature: float, gpt=None):
        """Label-grid ``[b, L]`` log-probs and entropies at the loss tokens of ``micro``
        (projected with ``gpt``'s output weight: the policy's by default)."""
        # Positions 1.. are predicted from 0..; packed, the first token of a sequence is
        # a prompt token, never a loss token, so no prediction crosses a boundary. The
        # loss tokens are enumerated in the same order on the token grid and on the
        # sequence grid (sequence by sequence, in the row's order).
        inputs = micro.input_loss_mask[:, 1:].bool()
        states = hidden[:, :-1][inputs]  # [n, h]
        targets = micro.tokens[:, 1:][inputs]
        selected = micro.loss_mask[:, 1:].bool()
        if micro.token_loss_mask is not None and states.shape[0] != int(selected.sum()):
            # masked_scatter below would silently drop or leave out values.
            raise RuntimeError(
                f"a packed micro-batch has {states.shape[0]} loss tokens on its row but {int(selected.sum())} "
                "on its sequences' grid"
            )
        weight = output_weight(gpt if gpt is not None else self.gpt)
        # bf16: the last stage's Float16Module hands back fp32 copies of bf16 hidden
        # states; back in bf16 (exactly), the projection is the output layer's.
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            states.to(weight.dtype),
            weight,
            targets,
            vocab_size=self.model_config.vocab_size,
            vocab_start=self.vocab_start,
            temperature=temperature,
            group=self.tp_group,
        )

        def to_grid(values: torch.Tensor) -> torch.Tensor:
            grid = torch.zeros(selected.shape, dtype=values.dtype, device=values.device).masked_scatter(
                selected, values
            )
            return torch.nn.functional.pad(grid, (1, 0))

        return to_grid(log_probs), to_grid(entropy)

    def _run_schedule(self, micro: list[_MicroBatch], forward_step, forward_only: bool, model=None) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[model if model is not None else self.ddp],
            num_microbatches=len(micro),
            seq_length=max(m.tokens.shape[1] for m in micro),
            micro_batch_size=max(m.tokens.shape[0] for m in micro),
            forward_only=forward_only,
        )

    def _broadcast_from_last_stage(self, tensor: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        if self.parallel.pp_size > 1:
            dist.broadcast(tensor, src=self.pp_last_rank, group=self.pp_group)
        return tensor

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def compute_log_probs(
        self, batch: PolicyBatch, temperature: float = 1.0, num_mini_batches: int = 1, reference: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward-only log-probs and entropy of ``batch``'s loss tokens under the current weights.

        ``batch`` and ``num_mini_batches`` are what :meth:`train` will receive: the pass
        runs the very micro-batches of the updates (the same rows in the same padded
        shapes, in the same order), so the first update recomputes each log-prob with the
        same kernels on the same data and its ratio is exactly 1 on any CPU, whatever
        its BLAS does with a different row count.

        ``reference``: under the KL penalty's reference policy instead (``use_kl_loss``).

        Returns ``[batch, seq]`` fp32 grids (zero outside the loss tokens) on every rank.
        """
        batch.check_target_ids(self.model_config.vocab_size)
        if reference and self.reference is None:
            raise ValueError("reference log-probs need algorithm.use_kl_loss (the actor holds no reference policy)")
        gpt = self.reference if reference else None
        self.ddp.eval()
        micro = [mb for mini in self._update_micro_batches(batch, num_mini_batches) for mb in mini]
        routing = self.reference_routing if reference else self.routing
        if routing is not None:
            routing.begin("record")
        index = iter(range(len(micro)))

        def forward_step(data_iterator: Iterator[_MicroBatch], model):
            mb = next(data_iterator)
            if routing is not None:
                _route(routing, next(index), mb)
            hidden = self._forward(model, mb)

            def loss_func(output):
                log_probs, entropy = self._log_probs_and_entropy(output, mb, temperature, gpt)
                zero = torch.zeros((), device=output.device)
                return (
                    zero,
                    torch.zeros((), dtype=torch.int),
                    {"rows": mb.rows, "log_probs": log_probs, "entropy": entropy},
                )

            return hidden, loss_func

        outputs = self._run_schedule(
            micro, forward_step, forward_only=True, model=self.reference_module if reference else None
        )
        if routing is not None:
            from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

            routing.begin(None)
            clear_aux_losses_tracker()
        shape = (2, batch.num_rows, batch.tokens.shape[1])
        result = None
        if self.is_last_stage:
            result = torch.zeros(shape, dtype=torch.float32, device=self.device)
            for out in outputs:
                width = min(out["log_probs"].shape[1], shape[2])
                result[0, out["rows"], :width] = out["log_probs"][:, :width]
                result[1, out["rows"], :width] = out["entropy"][:, :width]
        result = self._broadcast_from_last_stage(result, shape, torch.float32)
        self.ddp.train()
        return result[0].cpu(), result[1].cpu()

    def train(self, batch: PolicyBatch, num_mini_batches: int = 1, temperature: float = 1.0) -> list[UpdateMetrics]:
        """One rollout step: ``num_mini_batches`` DAPO updates on this rank's share of the batch.

        ``batch`` holds this data-parallel rank's rows (see ``shard_for_data_parallel``)
        with ``advantages`` and ``old_log_probs``; it is split into ``num_mini_batches``
        consecutive parts, one optimizer update each. ``temperature`` is the sampling
        temperature the old log-probs were computed at (``log_softmax(logits / T)``); the
        new policy's log-probs use the same one, so the first update's ratio is exactly 1
        on-policy. Returns each update's :class:`UpdateMetrics` (equal on every rank): an
        update whose loss or gradient is NaN or infinite on any rank is not applied on any
        rank and reports ``nonfinite`` and ``update_skipped``; a mini-batch without loss
        tokens makes no update and reports ``empty`` (checked before the scheduler or the
        step counter move).
        """
        if batch.advantages is None or batch.old_log_probs is None:
            raise ValueError("train() needs a batch with advantages and old_log_probs")
        if (self.reference is not None) != (batch.ref_log_probs is not None):
            raise ValueError(
                "algorithm.use_kl_loss needs the batch's ref_log_probs (compute_log_probs(..., reference=True)), "
                "and only then"
            )
        minis = batch.split(num_mini_batches)
        vocab_size = self.model_config.vocab_size
        # One all-reduce, before any micro-batch and before any state changes: loss tokens
        # (and, for the seq-mean ablations, sequences with loss tokens) of every global
        # mini-batch, and the loss tokens outside the vocabulary on any rank (so that
        # every rank refuses the batch together instead of one rank leaving the others
        # waiting in a collective).
        counts = torch.tensor(
            [[float(m.response_mask().sum()), float((m.response_mask().sum(-1) > 0).sum())] for m in minis]
            + [[float(batch.invalid_target_ids(vocab_size).numel()), 0.0]],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(counts, group=self.dp_group)
        counts, invalid = counts[:-1], int(counts[-1, 0])
        if invalid:
            batch.check_target_ids(vocab_size)  # names the id on the rank that has it
            raise ValueError(
                f"{invalid} response token id(s) on another data-parallel rank are outside the vocabulary of "
                f"{vocab_size} ids"
            )
        planned = self._update_micro_batches(batch, num_mini_batches)
        padding = self._padding_shares(batch, num_mini_batches, planned)
        self.scheduler.step(1)
        self.rollout_step += 1
        metrics = []
        first = 0  # the index of the update's first micro-batch in the step's order
        for micro, (num_tokens, num_seqs) in zip(planned, counts.tolist()):
            if num_tokens <= 0:
                # Every row filtered out (e.g. all truncated under overlong filtering) on
                # every rank: no update; counted, and the step goes on.
                metrics.append(UpdateMetrics.empty_update(float(self.optimizer.param_groups[0]["lr"])))
            else:
                metrics.append(self._update(micro, num_tokens, num_seqs, temperature, first))
            first += len(micro)
        for update in metrics:
            update.padding_share, update.padding_share_unpacked = padding
        if self.routing is not None:
            self.routing.end_step()
        return metrics

    def _padding_shares(self, batch: PolicyBatch, num_mini_batches: int, planned) -> tuple[float, float]:
        """The share of padding in the tokens the actor runs for ``batch`` (over every
        data-parallel rank): as planned (``padding_share``), and as padded rows of one
        sequence each would have it (``padding_share_unpacked``)."""
        run = sum(mb.tokens.numel() for micro in planned for mb in micro)
        unpacked = 0
        lengths = batch.seq_lengths.tolist()
        size = len(lengths) // num_mini_batches
        for start in range(0, len(lengths), size):
            mini = lengths[start : start + size]
            for rows in plan_micro_batches(mini, self.trainer.micro_batch_max_tokens, self.pad_multiple):
                unpacked += len(rows) * round_up(max(mini[i] for i in rows), self.pad_multiple)
        totals = torch.tensor(
            [float(batch.seq_lengths.sum()), float(run), float(unpacked)], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(totals, group=self.dp_group)
        real, run, unpacked = totals.tolist()
        return 1.0 - real / run if run else 0.0, 1.0 - real / unpacked if unpacked else 0.0

    def _loss_and_gradients_finite(self, outputs: list[dict]) -> bool:
        """Whether every rank's losses and reduced gradients are finite (agreed by all ranks)."""
        local = all(bool(torch.isfinite(out["loss"]).all()) for out in outputs if "loss" in out)
        # Experts' gradients live in buffers of their own (reduced over the expert-data-parallel group).
        for buffer in [*self.ddp.buffers, *(getattr(self.ddp, "expert_parallel_buffers", None) or [])]:
            local = local and bool(torch.isfinite(buffer.grad_data).all())
        flag = torch.tensor([1.0 if local else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() == 1.0)

    def _update(
        self,
        micro: list[_MicroBatch],
        global_num_tokens: float,
        global_num_seqs: float,
        temperature: float,
        first: int = 0,
    ) -> UpdateMetrics:
        """One optimizer update on ``micro`` (whose first micro-batch is the step's
        ``first``-th, in the order of the old-log-prob pass)."""
        algo = self.algorithm
        routing = self.routing
        if routing is not None:
            routing.begin("compare")
            routing.scale_for_update(sum(mb.rows.numel() > 0 for mb in micro), self.dp_group)
        index = iter(range(first, first + len(micro)))

        def forward_step(data_iterator: Iterator[_MicroBatch], model):
            mb = next(data_iterator)
            if routing is not None:
                _route(routing, next(index), mb)
            hidden = self._forward(model, mb)
            if routing is not None:
                routing.again_in_backward(hidden)

            def loss_func(output):
                log_probs, entropy = self._log_probs_and_entropy(output, mb, temperature)
                # A diverged model (NaN or infinite log-probs) makes a NaN loss, which the
                # finite check after the schedule turns into a skipped update on every rank.
                finite = torch.isfinite(log_probs) | (mb.loss_mask == 0)
                diverged = not bool(finite.all())
                if diverged:
                    log_probs = torch.where(finite, log_probs, torch.zeros_like(log_probs))
                loss, m = dapo_policy_loss(
                    log_probs,
                    mb.old_log_probs,
                    mb.advantages,
                    mb.loss_mask,
                    clip_ratio_low=algo.clip_ratio_low,
                    clip_ratio_high=algo.clip_ratio_high,
                    clip_ratio_c=algo.clip_ratio_c,
                    loss_agg_mode=algo.loss_agg_mode,
                    global_num_tokens=global_num_tokens,
                    global_num_seqs=global_num_seqs,
                    token_weights=mb.token_weights,
                    ref_log_probs=mb.ref_log_probs,
                    kl_coef=algo.kl_loss_coef,
                    kl_type=algo.kl_loss_type,
                )
                if diverged:
                    loss = loss * float("nan")
                n = m["num_tokens"].to(torch.float64)
                mask = mb.loss_mask
                # The update's TOKEN_SUMS (UpdateMetrics), and its largest ratio.
                sums = {
                    "loss": loss.detach().to(torch.float64),
                    "entropy": (entropy.detach() * mask).sum().to(torch.float64),
                    "mean_prob": (torch.exp(log_probs.detach()) * mask).sum().to(torch.float64),
                    **{name: m[name].to(torch.float64) * n for name in LOSS_MEANS},
                    "tokens": n,
                    "ratio_max": m["ratio_max"].to(torch.float64),
                }
                return loss, m["num_tokens"].to(torch.int), sums

            return hidden, loss_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(micro, forward_step, forward_only=False)
        finite = self._loss_and_gradients_finite(outputs)
        if finite:
            update_ok, grad_norm, _ = self.optimizer.step()
        else:
            # A NaN or infinite loss or gradient on any rank: no rank updates (weights and
            # optimizer state stay as they were; the next update zeroes the gradients).
            update_ok, grad_norm = False, float("nan")
        totals = torch.zeros(len(TOKEN_SUMS) + 1, dtype=torch.float64, device=self.device)
        if self.is_last_stage:
            for out in outputs:
                totals[:-1] += torch.stack([out[name].to(totals.device) for name in TOKEN_SUMS])
                totals[-1] = torch.maximum(totals[-1], out["ratio_max"].to(totals.device))
        sums, ratio_max = totals[:-1].clone(), totals[-1:].clone()
        dist.all_reduce(sums, group=self.dp_group)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX, group=self.dp_group)
        totals = self._broadcast_from_last_stage(torch.cat([sums, ratio_max]), totals.shape, totals.dtype)
        return UpdateMetrics.from_sums(
            totals[:-1].tolist(),
            float(totals[-1]),
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            stepped=bool(update_ok),
            finite=finite,
            lr=float(self.optimizer.param_groups[0]["lr"]),
            num_micro_batches=len(micro),
            routing=routing.metrics() if routing is not None else {},
        )
