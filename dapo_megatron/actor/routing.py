"""What the routers of a mixture-of-experts actor did, and the scale of their loss.

Two things megatron's MoE layer leaves to the trainer:

- **The load-balancing loss's weight.** With ``calculate_per_token_loss`` megatron scales
  each micro-batch's auxiliary loss by its token count, expecting ``finalize_model_grads``
  to divide everything by the global token count. This actor divides its policy loss
  itself (and gives ``finalize_model_grads`` no count), so that scaling would weigh the
  auxiliary loss by the number of tokens. Instead each router's per-token scaling is
  turned off and, for each update, the coefficient megatron applies is the configured
  one divided by the update's micro-batches over all data-parallel ranks: the update
  minimises the policy loss plus ``moe_aux_loss_coeff`` times the mean over micro-batches
  of megatron's per-micro-batch load-balancing loss (as without per-token loss).
- **Metrics.** Forward hooks on the routers count the tokens each expert receives (the
  max over the mean, per layer) and keep which experts each response token went to in
  the old-log-prob pass, so that each update can report the share of response tokens
  whose top-k experts changed since (routing instability: 0 on-policy, then the drift of
  the updates before it). Comparisons are made only between the very same micro-batches
  (same tokens), which the actor's passes guarantee.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def routers_of(gpt) -> list:
    """This stage's routers, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [module for module in gpt.modules() if isinstance(module, TopKRouter)]


class RoutingMonitor:
    """Router hooks and the load-balancing loss's scale for one actor's model."""

    def __init__(self, gpt, coefficient: float, tp_rank: int, tp_size: int, sequence_parallel: bool) -> None:
        self.routers = routers_of(gpt)
        self.config = gpt.config
        self.coefficient = coefficient
        self.num_layers = gpt.config.num_layers
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        self.mode: Optional[str] = None  # "record" (old log-probs), "compare" (an update), or None
        self.current: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None  # index, tokens, valid
        self.recorded: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._seen: set[tuple[int, int]] = set()
        self.counts = torch.zeros(self.num_layers, gpt.config.num_moe_experts, dtype=torch.float64)
        self.changed = torch.zeros(2, dtype=torch.float64)  # changed, compared
        for router in self.routers:
            router.calculate_per_token_loss = False
            router.register_forward_hook(self._hook)

    def begin(self, mode: Optional[str]) -> None:
        """Start a pass: ``record`` the routing of the old-log-prob pass, or ``compare`` an
        update's with it."""
        self.mode, self._seen = mode, set()
        if mode == "record":
            self.recorded = {}
        self.counts.zero_()
        self.changed.zero_()

    def micro_batch(self, index: int, tokens: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """The micro-batch about to run (``index``: its place in the step's order): its
        tokens, and which of its tokens are response tokens, in the router's token order
        (sequence-major, this rank's part of the sequence under sequence parallelism)."""
        valid = loss_mask.t()
        if self.sequence_parallel and self.tp_size > 1:
            chunk = valid.shape[0] // self.tp_size
            valid = valid[self.tp_rank * chunk : (self.tp_rank + 1) * chunk]
        self.current = (index, tokens, valid.reshape(-1).bool())

    def _hook(self, router, inputs, outputs) -> None:
        if self.mode is None or self.current is None:
            return
        index, tokens, valid = self.current
        layer = router.layer_number - 1
        if (index, layer) in self._seen:  # activation recompute runs the forward again
            return
        self._seen.add((index, layer))
        routing_map = outputs[1].detach().cpu()
        valid = valid.cpu()
        self.counts[layer] += routing_map[valid].sum(0).to(torch.float64)
        if self.mode == "record":
            self.recorded[(index, layer)] = (tokens.detach().cpu(), routing_map[valid])
        elif self.mode == "compare":
            before = self.recorded.get((index, layer))
            if before is not None and torch.equal(before[0], tokens.detach().cpu()):
                now = routing_map[valid]
                self.changed += torch.tensor([float((now != before[1]).any(-1).sum()), float(now.shape[0])])

    def scale_for_update(self, num_micro_batches: int, group) -> None:
        """Set the coefficient megatron applies during the coming update: the configured one
        over the update's micro-batches summed over ``group`` (data-parallel ranks)."""
        total = torch.tensor([float(num_micro_batches)], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        self.config.moe_aux_loss_coeff = self.coefficient / max(float(total), 1.0)

    def metrics(self, device) -> dict[str, float]:
        """The pass's routing metrics over every rank (a collective over all of them)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        # Sum over micro-batches of each layer's loss (megatron's tracker), per layer.
        balance = torch.zeros(2, dtype=torch.float64)
        if tracker is not None and self.routers:
            values = tracker["values"].detach().cpu().to(torch.float64)
            calls = max(len(self._seen), 1) / len(self.routers)
            balance += torch.tensor([float(values.sum()) / calls, float(len(self.routers))])
        clear_aux_losses_tracker()
        totals = torch.cat([self.counts.reshape(-1), self.changed, balance]).to(device)
        dist.all_reduce(totals)
        totals = totals.cpu()
        counts = totals[: self.counts.numel()].reshape(self.counts.shape)
        changed, compared, balance_sum, balance_layers = totals[self.counts.numel() :].tolist()
        per_layer = counts.max(-1).values / counts.mean(-1).clamp(min=1e-12)
        routed = counts.sum(-1) > 0
        out = {
            "moe_tokens_per_expert_max_over_mean": float(per_layer[routed].mean()) if routed.any() else 0.0,
            "moe_tokens_per_expert_max_over_mean_worst_layer": float(per_layer[routed].max()) if routed.any() else 0.0,
        }
        if compared:
            out["moe_routing_changed"] = changed / compared
        if balance_layers:
            out["moe_load_balancing_loss"] = balance_sum / balance_layers
        return out
