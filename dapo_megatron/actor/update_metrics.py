"""What one DAPO update reports, as one type: :class:`UpdateMetrics`.

The actor's loss function adds up token-weighted sums over micro-batches and
data-parallel ranks (:data:`TOKEN_SUMS`); :meth:`UpdateMetrics.from_sums` turns them into
the update's means, :meth:`UpdateMetrics.empty` is the update a mini-batch without loss
tokens does not make, and :meth:`UpdateMetrics.merge` turns a step's updates into the
step's ``actor/*`` and ``moe/*`` metrics. The names of the figures are spelled once, as
the fields; nothing else of the package re-aggregates them by string.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

LOSS_MEANS = (
    "pg_clipfrac_low",
    "pg_clipfrac_high",
    "pg_clipfrac_dual",
    "approx_kl",
    "ratio_mean",
    "log_ratio_clamped",
    "kl_loss",
)
"""The figures the loss function reports as means over a micro-batch's loss tokens
(:func:`dapo_megatron.algo.loss.dapo_policy_loss`), under the same names."""

TOKEN_SUMS = ("loss", "entropy", "mean_prob", *LOSS_MEANS, "tokens")
"""The figures the loss function sums over an update's micro-batches and data-parallel
ranks, in the order of the summed vector: ``loss`` as it is (already divided by the
global token count), ``tokens`` (the loss tokens), and the others weighted by their
micro-batch's loss tokens (``entropy`` and ``mean_prob`` summed over the tokens)."""


@dataclass
class UpdateMetrics:
    """One optimizer update's figures, equal on every rank."""

    loss: float
    """The DAPO loss: the global token mean."""
    entropy: float
    """Mean entropy of the policy at the loss tokens."""
    mean_prob: float
    """Mean probability of the sampled tokens under the updated policy."""
    pg_clipfrac_low: float
    """Share of loss tokens clipped below (ratio < 1 - eps_low, negative advantage)."""
    pg_clipfrac_high: float
    """Share of loss tokens clipped above (ratio > 1 + eps_high, positive advantage)."""
    pg_clipfrac_dual: float
    """Share of loss tokens under the dual clip (negative advantage, ratio > c)."""
    approx_kl: float
    """Mean ``old - new`` log-prob over the loss tokens."""
    ratio_mean: float
    """Mean importance ratio new / old."""
    ratio_max: float
    """Largest importance ratio (over every rank)."""
    log_ratio_clamped: float
    """Share of loss tokens whose log-ratio was clamped to keep ``exp`` finite."""
    kl_loss: float
    """Mean KL penalty to the reference policy (``algorithm.use_kl_loss``)."""
    tokens: float
    """Loss tokens of the update (every data-parallel rank)."""
    grad_norm: float
    """The gradient's norm before clipping (NaN when no step was taken)."""
    update_skipped: float
    """1 when the optimizer made no step (non-finite, empty, or skipped by the optimizer)."""
    nonfinite: float
    """1 when the loss or a gradient was NaN or infinite on some rank (no rank updated)."""
    lr: float
    """The learning rate of the update."""
    num_micro_batches: float
    """Micro-batches of this rank's share of the update."""
    empty: float = 0.0
    """1 for a mini-batch without loss tokens: no update was made (only counted)."""
    padding_share: float = 0.0
    """Share of padding in the tokens the actor ran for the step (every rank)."""
    padding_share_unpacked: float = 0.0
    """The same share had every row held one sequence (without packing)."""
    routing: dict[str, float] = field(default_factory=dict)
    """A mixture-of-experts actor's routing figures (``actor/routing.py``): expert load,
    routing changed against the old-log-prob pass, load-balancing loss."""

    @classmethod
    def from_sums(
        cls,
        sums: list[float],
        ratio_max: float,
        *,
        grad_norm: float,
        stepped: bool,
        finite: bool,
        lr: float,
        num_micro_batches: int,
        routing: dict[str, float],
    ) -> UpdateMetrics:
        """An update's figures from its :data:`TOKEN_SUMS` (reduced over every rank)."""
        summed = dict(zip(TOKEN_SUMS, sums))
        tokens = max(summed["tokens"], 1.0)
        means = {name: summed[name] / tokens for name in TOKEN_SUMS if name not in ("loss", "tokens")}
        return cls(
            loss=summed["loss"],
            tokens=summed["tokens"],
            ratio_max=ratio_max,
            grad_norm=grad_norm,
            update_skipped=0.0 if stepped else 1.0,
            nonfinite=0.0 if finite else 1.0,
            lr=lr,
            num_micro_batches=float(num_micro_batches),
            routing=routing,
            **means,
        )

    @classmethod
    def empty_update(cls, lr: float) -> UpdateMetrics:
        """A mini-batch without loss tokens: no optimizer step."""
        zeros = dict.fromkeys(TOKEN_SUMS, 0.0)
        return cls(
            **zeros,
            ratio_max=0.0,
            grad_norm=float("nan"),
            update_skipped=1.0,
            nonfinite=0.0,
            lr=lr,
            num_micro_batches=0.0,
            empty=1.0,
        )

    def as_dict(self) -> dict[str, float]:
        """The fields by name, the routing figures among them (for files and tests)."""
        values = dataclasses.asdict(self)
        return {**{k: v for k, v in values.items() if k != "routing"}, **self.routing}

    @staticmethod
    def merge(all_updates: list[UpdateMetrics]) -> dict[str, float]:
        """A step's updates as one set of metrics: token-weighted means, the largest ratio,
        the last learning rate. Mini-batches without loss tokens made no update and are
        only counted. A mixture-of-experts actor's routing: the first update's
        ``routing_changed`` is the on-policy one (0); the step reports the later ones'
        mean and the largest, the rest as means over updates."""
        updates = [u for u in all_updates if not u.empty] or all_updates
        tokens = sum(u.tokens for u in updates) or 1.0

        def mean(name: str) -> float:
            return sum(getattr(u, name) * u.tokens for u in updates) / tokens

        return {
            **_merge_routing([u.routing for u in updates]),
            "actor/loss": sum(u.loss for u in updates) / len(updates),
            **{f"actor/{name}": mean(name) for name in TOKEN_SUMS if name not in ("loss", "tokens")},
            "actor/ratio_max": max(u.ratio_max for u in updates),
            "actor/empty_mini_batches": float(sum(u.empty for u in all_updates)),
            "actor/first_update_ratio_max": updates[0].ratio_max,
            "actor/grad_norm": sum(u.grad_norm for u in updates) / len(updates),
            "actor/lr": updates[-1].lr,
            "actor/num_updates": float(len(updates)),
            "actor/updates_skipped": sum(u.update_skipped for u in updates),
            "actor/nonfinite_updates": sum(u.nonfinite for u in updates),
            "actor/tokens": float(tokens),
            "actor/padding_share": all_updates[0].padding_share,
            "actor/padding_share_unpacked": all_updates[0].padding_share_unpacked,
        }


def _merge_routing(routings: list[dict[str, float]]) -> dict[str, float]:
    if "moe_tokens_per_expert_max_over_mean" not in routings[0]:
        return {}
    later = [r["moe_routing_changed"] for r in routings[1:] if "moe_routing_changed" in r]
    merged = {
        "moe/tokens_per_expert_max_over_mean": sum(r["moe_tokens_per_expert_max_over_mean"] for r in routings)
        / len(routings),
        "moe/tokens_per_expert_max_over_mean_worst_layer": max(
            r["moe_tokens_per_expert_max_over_mean_worst_layer"] for r in routings
        ),
    }
    if later:
        merged.update({"moe/routing_changed": sum(later) / len(later), "moe/routing_changed_max": max(later)})
    if "moe_routing_changed_engine" in routings[0]:  # the first update routes as the old-log-prob pass did
        merged["moe/routing_changed_engine"] = routings[0]["moe_routing_changed_engine"]
    if "moe_replayed_share" in routings[0]:
        merged["moe/replayed_share"] = sum(r.get("moe_replayed_share", 0.0) for r in routings) / len(routings)
    if "moe_load_balancing_loss" in routings[0]:
        merged["moe/load_balancing_loss"] = sum(r["moe_load_balancing_loss"] for r in routings) / len(routings)
    return merged
