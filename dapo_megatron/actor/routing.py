"""What the routers of a mixture-of-experts actor did, and the weight of their losses.

Two things megatron's MoE layer leaves to the trainer:

- **The router losses' weight.** With ``calculate_per_token_loss`` megatron scales each
  micro-batch's auxiliary loss by its token count, expecting ``finalize_model_grads`` to
  divide everything by the global token count. This actor divides its policy loss itself
  (and gives ``finalize_model_grads`` no count), so that scaling would weigh the
  auxiliary loss by the number of tokens. Instead each router's per-token scaling is
  turned off and, for each micro-batch, the coefficients megatron applies (load
  balancing and z-loss) are the configured ones divided by the update's micro-batches
  over all data-parallel ranks: the update minimises the policy loss plus each
  coefficient times the mean over micro-batches of megatron's per-micro-batch loss (as
  without per-token loss). Filler micro-batches (the padding that keeps replicas in step
  under expert parallelism) get a negligible coefficient and are left out of the mean and
  of the metrics. Megatron reads the coefficients when a router runs, which under full
  activation recompute is in the micro-batch's backward: with pipelining (1F1B) that
  comes after later micro-batches' forwards, so each micro-batch's coefficients are set
  again when its backward starts (:meth:`RoutingMonitor.again_in_backward`).
- **Metrics.** Forward hooks on the routers count the tokens each expert receives (the
  max over the mean, per layer) and keep a fingerprint of which experts each of the
  first :data:`SAMPLED_TOKENS` response tokens of a micro-batch went to in the
  old-log-prob pass, so that each update can report the share of those tokens whose
  top-k experts changed since (routing instability: 0 on-policy, then the drift of the
  updates before it). Everything stays on the device until the pass ends (no
  synchronisation per layer), and comparisons are made only between the very same
  micro-batches, which the actor's passes guarantee. When the batch carries the engine's
  routing (``model.routing_replay``), each pass also counts the positions the engine
  routed whose top-k experts the actor's routers now pick otherwise
  (``routing_changed_engine``).
- **Routing replay** (``model.routing_replay``, megatron's ``RouterReplay``: a router in
  ``REPLAY_FORWARD`` takes the experts it is given instead of its top-k, and gathers its
  own scores at them). ``rollout``: every pass replays the engine's experts (positions it
  did not route take experts ``0..k-1``, and are padding for the router losses).
  ``old``: the old-log-prob pass routes on its own and records what it picked, per
  micro-batch and layer; every update replays that. The experts are set with the
  coefficients, so under recompute and pipelining the router reads the micro-batch's own
  when it runs again in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

SAMPLED_TOKENS = 256
"""Response tokens per micro-batch whose routing is compared between the passes."""
FILLER_COEFFICIENT = 1e-30
"""The router losses' coefficient in a filler micro-batch: no gradient to speak of, and a
non-zero value megatron's loss tracker can divide by."""


def routers_of(gpt) -> list:
    """This stage's routers, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [module for module in gpt.modules() if isinstance(module, TopKRouter)]


@dataclass
class _Current:
    """The micro-batch the routers are about to run, in the routers' token order
    (sequence-major, this rank's part of the sequence under sequence parallelism)."""

    index: int  # its place in the step's order
    tokens: torch.Tensor  # [b, L] its token grid (the identity check of the comparisons)
    valid: torch.Tensor  # [tokens] bool: response (loss) tokens
    filler: bool
    engine_experts: Optional[torch.Tensor] = None  # [tokens, moe_layers, k] the engine's routing
    engine_routed: Optional[torch.Tensor] = None  # [tokens] bool: the positions the engine routed
    predicting: Optional[torch.Tensor] = None  # [tokens] bool: the positions whose output is a loss token's log-prob
    engine_routed_any: bool = False  # the engine routed some position of it (on any rank's part)


def _tracker() -> dict:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return get_moe_layer_wise_logging_tracker()


class RoutingMonitor:
    """Router hooks and the router losses' scale for one actor's model."""

    def __init__(self, gpt, model_config, device, tp_rank: int, tp_size: int, sequence_parallel: bool) -> None:
        from dapo_megatron.config import moe_layers

        self.routers = routers_of(gpt)
        self.replay = model_config.routing_replay
        pattern = moe_layers(model_config)
        # A router's global layer number -> its MoE layer's place among the MoE layers.
        self.ordinal = {layer + 1: sum(pattern[:layer]) for layer in range(len(pattern)) if pattern[layer]}
        self.config = gpt.config
        # Each loss's "off" as megatron tests it: the load-balancing loss is skipped when its
        # coefficient == 0, the z-loss only when it is None (0.0 would still compute a
        # logsumexp per layer and store z_loss / 0 = NaN in megatron's tracker).
        self.coefficients: dict[str, Optional[float]] = {
            "moe_aux_loss_coeff": model_config.moe_aux_loss_coeff or 0.0,
            "moe_z_loss_coeff": model_config.moe_z_loss_coeff or None,
        }
        self.scaled = dict(self.coefficients)
        self.device = device
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        self.mode: Optional[str] = None  # "record" (old log-probs), "compare" (an update), or None
        self.current: Optional[_Current] = None
        self.recorded: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # routing_replay "old": each (micro-batch, layer)'s experts in the old-log-prob pass.
        self.old_experts: dict[tuple[int, int], torch.Tensor] = {}
        self._seen: set[tuple[int, int]] = set()
        self._tracked_before: dict[int, dict[str, torch.Tensor]] = {}
        num_layers = gpt.config.num_layers
        self.counts = torch.zeros(num_layers, gpt.config.num_moe_experts, dtype=torch.float64, device=device)
        self.changed = torch.zeros(2, dtype=torch.float64, device=device)  # changed, compared
        # Against the engine: changed, compared; positions predicting a loss token replayed, all such positions.
        self.engine_changed = torch.zeros(4, dtype=torch.float64, device=device)
        self.real_calls = 0
        # A random 63-bit key per expert: a token's expert set is the sum of its experts' keys.
        generator = torch.Generator().manual_seed(0)
        self.keys = torch.randint(0, 2**62, (gpt.config.num_moe_experts,), generator=generator).to(device)
        for router in self.routers:
            router.calculate_per_token_loss = False
            router.register_forward_pre_hook(self._pre_hook)
            router.register_forward_hook(self._hook)

    def begin(self, mode: Optional[str]) -> None:
        """Start a pass: ``record`` the routing of the old-log-prob pass, or ``compare`` an
        update's with it."""
        self.mode, self._seen, self.real_calls = mode, set(), 0
        if mode == "record":
            self.recorded, self.old_experts = {}, {}
        self.counts.zero_()
        self.changed.zero_()
        self.engine_changed.zero_()
        if mode is None:
            self.current = None
            self._set_replay(None)

    def end_step(self) -> None:
        """The step's updates are done: no router replays anything until the next pass,
        and the old-log-prob pass's experts (``old``) are let go."""
        self.begin(None)
        self.old_experts = {}

    def _router_order(self, grid: torch.Tensor) -> torch.Tensor:
        """A ``[b, L, ...]`` grid in the routers' token order: sequence-major, this rank's
        part of the sequence under sequence parallelism, flattened to ``[tokens, ...]``."""
        ordered = grid.transpose(0, 1)
        if self.sequence_parallel and self.tp_size > 1:
            chunk = ordered.shape[0] // self.tp_size
            ordered = ordered[self.tp_rank * chunk : (self.tp_rank + 1) * chunk]
        return ordered.reshape(-1, *grid.shape[2:])

    def micro_batch(
        self,
        index: int,
        tokens: torch.Tensor,
        loss_mask: torch.Tensor,
        filler: bool = False,
        engine_experts: Optional[torch.Tensor] = None,
        engine_routed: Optional[torch.Tensor] = None,
        engine_routed_any: bool = False,
    ) -> None:
        """The micro-batch about to run (``index``: its place in the step's order): its
        tokens, which of them are response tokens, whether it is a filler and, when the
        batch carries it, the engine's routing (``[b, L, moe_layers, k]``), which
        positions it covers and whether it covers any; sets the router losses' coefficients and the experts to
        replay for it."""
        predicting = torch.zeros_like(loss_mask)
        predicting[:, :-1] = loss_mask[:, 1:]  # position p gives the log-prob of token p + 1
        self._activate(
            _Current(
                index,
                tokens,
                self._router_order(loss_mask).bool(),
                filler,
                None if engine_experts is None else self._router_order(engine_experts),
                None if engine_routed is None else self._router_order(engine_routed),
                self._router_order(predicting).bool(),
                engine_routed_any,
            )
        )

    def _activate(self, current: _Current) -> None:
        self.current = current
        for name, value in self.scaled.items():
            setattr(self.config, name, FILLER_COEFFICIENT if current.filler and value else value)
        self._set_replay(current)

    def _set_replay(self, current: Optional[_Current]) -> None:
        """Each router's replay for ``current``: the experts it takes, or its own top-k."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in self.routers:
            replay = router.router_replay
            if replay is None:
                continue
            replay.clear_indices()
            experts = self._replayed_experts(current, router.layer_number) if current is not None else None
            if experts is None:
                replay.clear_router_replay_action()
            else:
                replay.set_target_indices(experts)
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _replayed_experts(self, current: _Current, layer_number: int) -> Optional[torch.Tensor]:
        if current.filler or self.mode is None:
            return None
        if self.replay == "rollout" and current.engine_experts is not None and current.engine_routed_any:
            # (A micro-batch without any recorded position routes on its own: none of its
            # tokens is in the loss, and its router losses then see real routing.)
            return current.engine_experts[:, self.ordinal[layer_number]].long()
        if self.replay == "old" and self.mode == "compare":
            experts = self.old_experts.get((current.index, layer_number - 1))
            return None if experts is None else experts.long()
        return None

    def again_in_backward(self, output: torch.Tensor) -> None:
        """Make the current micro-batch current again when the backward reaches
        ``output`` (the model's output for it): under full activation recompute the
        routers run again there, reading the coefficients and this monitor's state, and
        with pipelining that backward comes after later micro-batches' forwards (1F1B),
        which set both for themselves. A hook on the output runs before any of the
        model's backward, hence before its recompute."""
        current = self.current
        if current is not None and output.requires_grad:
            output.register_hook(lambda grad: self._activate(current))

    def _pre_hook(self, router, inputs) -> None:
        # A filler's losses are kept out of megatron's tracker: remember the layer's values.
        if self.current is not None and self.current.filler:
            self._tracked_before[router.layer_number] = {
                name: entry["values"].clone() for name, entry in _tracker().items() if "values" in entry
            }

    def _hook(self, router, inputs, outputs) -> None:
        if self.current is None:
            return
        current = self.current
        index, tokens, valid, filler = current.index, current.tokens, current.valid, current.filler
        if filler:
            for name, values in self._tracked_before.pop(router.layer_number, {}).items():
                _tracker()[name]["values"].copy_(values)
            return
        if self.mode is None:
            return
        layer = router.layer_number - 1
        if (index, layer) in self._seen:  # activation recompute runs the forward again
            return
        self._seen.add((index, layer))
        self.real_calls += 1
        routing_map = outputs[1].detach()
        if self.replay == "old" and self.mode == "record":
            # Exactly k experts a token (no capacity limit), in a row-major order.
            experts = routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1)
            self.old_experts[(index, layer)] = experts.to(torch.uint8 if routing_map.shape[1] <= 256 else torch.int16)
        if current.engine_experts is not None:
            engine = torch.zeros_like(routing_map).scatter_(
                1, current.engine_experts[:, self.ordinal[router.layer_number]].long(), True
            )
            routed = current.engine_routed
            counted = [((engine != routing_map).any(-1) & routed).sum(), routed.sum()]
            if router.layer_number == min(self.ordinal):  # once per token: at the model's first MoE layer
                predicting = current.predicting
                replayed = (
                    (routed & predicting).sum() if self.replay == "rollout" else torch.zeros((), device=self.device)
                )
                counted += [replayed, predicting.sum()]
            else:
                counted += [torch.zeros((), device=self.device)] * 2
            self.engine_changed += torch.stack([value.to(torch.float64) for value in counted])
        routed = routing_map[valid.to(routing_map.device)]
        self.counts[layer] += routed.sum(0).to(torch.float64)
        sampled = routed[:SAMPLED_TOKENS]
        fingerprint = (sampled.to(torch.int64) * self.keys).sum(-1)
        token_check = torch.stack(
            [
                (
                    tokens.to(torch.int64)
                    * (1 + torch.arange(tokens.numel(), device=tokens.device).reshape(tokens.shape))
                ).sum()
            ]
        )
        if self.mode == "record":
            self.recorded[(index, layer)] = (
                torch.cat([torch.tensor(tokens.shape, device=tokens.device), token_check]),
                fingerprint,
            )
        elif self.mode == "compare":
            before = self.recorded.get((index, layer))
            now_check = torch.cat([torch.tensor(tokens.shape, device=tokens.device), token_check])
            if before is not None and before[0].shape == now_check.shape and before[1].shape == fingerprint.shape:
                same_tokens = (before[0] == now_check).all().to(torch.float64)
                differs = (before[1] != fingerprint).sum().to(torch.float64)
                self.changed += same_tokens * torch.stack(
                    [differs, torch.tensor(float(fingerprint.numel()), device=self.device, dtype=torch.float64)]
                )

    def scale_for_update(self, num_real_micro_batches: int, group) -> None:
        """Set the coefficients megatron applies during the coming update: the configured
        ones over the update's real micro-batches summed over ``group`` (data-parallel ranks)."""
        total = torch.tensor([float(num_real_micro_batches)], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=group)
        self.scaled = {
            name: value / max(float(total), 1.0) if value else value for name, value in self.coefficients.items()
        }

    def metrics(self) -> dict[str, float]:
        """The pass's routing metrics over every rank (a collective over all of them)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        tracker = _tracker().get("load_balancing_loss")
        # Sum over micro-batches of each layer's loss (megatron's tracker). Under sequence
        # parallelism each tensor-parallel rank's value is its part of the sequence's.
        balance = torch.zeros(2, dtype=torch.float64, device=self.device)
        if tracker is not None and self.routers and self.real_calls:
            calls = self.real_calls / len(self.routers)
            share = self.tp_size if self.sequence_parallel else 1
            values = tracker["values"].detach().to(device=self.device, dtype=torch.float64)
            balance += torch.stack(
                [values.sum() / calls, torch.tensor(len(self.routers) / share, device=self.device, dtype=torch.float64)]
            )
        clear_aux_losses_tracker()
        totals = torch.cat([self.counts.reshape(-1), self.changed, balance, self.engine_changed])
        dist.all_reduce(totals)
        totals = totals.cpu()
        counts = totals[: self.counts.numel()].reshape(self.counts.shape)
        changed, compared, balance_sum, balance_layers, *engine = totals[self.counts.numel() :].tolist()
        engine_changed, engine_compared, replayed, predicting = engine
        per_layer = counts.max(-1).values / counts.mean(-1).clamp(min=1e-12)
        routed = counts.sum(-1) > 0
        out = {
            "moe_tokens_per_expert_max_over_mean": float(per_layer[routed].mean()) if routed.any() else 0.0,
            "moe_tokens_per_expert_max_over_mean_worst_layer": float(per_layer[routed].max()) if routed.any() else 0.0,
        }
        if compared:
            out["moe_routing_changed"] = changed / compared
        if engine_compared:
            out["moe_routing_changed_engine"] = engine_changed / engine_compared
        if self.replay == "rollout" and predicting:
            out["moe_replayed_share"] = replayed / predicting
        if balance_layers:
            out["moe_load_balancing_loss"] = balance_sum / balance_layers
        return out
