"""Training-inference mismatch: how far the engine's sampling policy is from the actor's,
and the importance-sampling corrections for it.

The engine and the actor compute log-probs with different kernels, batch shapes and
reduction orders, so the policy that sampled a response (``rollout``, the engine's
log-probs) is not exactly the one the loss takes as old (``old``, the actor's log-probs
before the step's updates). With ``r = exp(old - rollout)`` per response token:

- **metrics**: the K3 estimate of KL(rollout || old) per token, ``r - 1 - log r``
  (non-negative, unbiased under samples of the rollout policy), its mean and max; the
  per-sequence log-ratio ``sum_t (old - rollout)`` and its extremes; the share of tokens
  with ``r`` outside ``[1/C, C]``.
- **TIS** (truncated importance sampling) weighs each token's loss by ``min(r, C)``, or
  every token of a response by ``min(prod_t r_t, C)`` at sequence level.
- **MIS** (masked importance sampling) keeps a token (sequence) in the loss only when its
  ratio lies in ``[1/C, C]``, and weighs it 1.

Weights are constants in the loss (no gradient flows through them). The token-mean
denominator stays the count of loss tokens *before* masking, so masking a token removes
its contribution without inflating the others'.
"""

from __future__ import annotations

import math

import torch

CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence")


def _log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` ``old - rollout`` at the loss tokens, 0 elsewhere (float64)."""
    diff = old_log_probs.double() - rollout_log_probs.double()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, cap: float
) -> dict[str, float]:
    """The mismatch between the rollout policy and the old policy at the ``mask``ed tokens
    (``[batch, seq]`` each; see the module docstring)."""
    keep = mask.bool()
    tokens = int(keep.sum())
    if tokens == 0:
        return {}
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, mask)
    k3 = torch.exp(log_ratio) - 1.0 - log_ratio  # 0 at masked-out positions
    rows = keep.any(dim=-1)
    seq_log_ratio = log_ratio.sum(dim=-1)[rows]
    outside = keep & (log_ratio.abs() > math.log(cap))
    return {
        "kl_k3_mean": float(k3.sum() / tokens),
        "kl_k3_max": float(k3[keep].max()),
        "seq_log_ratio_mean": float(seq_log_ratio.mean()),
        "seq_log_ratio_min": float(seq_log_ratio.min()),
        "seq_log_ratio_max": float(seq_log_ratio.max()),
        "ratio_outside_cap_share": float(outside.sum()) / tokens,
    }


def correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    correction: str,
    level: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[batch, seq]`` float32 loss weights of ``correction`` at ``level`` (1 at tokens it
    leaves alone; 0 outside ``mask``), and ``(weight_mean, masked_share)`` over the loss
    tokens. Computed in log space: a sequence's product of ratios cannot overflow."""
    if correction not in CORRECTIONS or level not in LEVELS:
        raise ValueError(
            f"correction must be one of {CORRECTIONS} and level one of {LEVELS}, got {correction!r}, {level!r}"
        )
    if not cap > 1:
        raise ValueError(f"the correction's cap must be > 1, got {cap}")
    keep = mask.bool()
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, mask)  # [batch, seq]
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    log_cap = math.log(cap)
    if correction == "none":
        weights = torch.ones_like(log_ratio)
    elif correction == "tis":
        weights = torch.exp(log_ratio.clamp(max=log_cap))
    else:
        weights = (log_ratio.abs() <= log_cap).double()
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    tokens = max(int(keep.sum()), 1)
    metrics = {
        "weight_mean": float(weights.sum() / tokens),
        "masked_share": float((keep & (weights == 0)).sum()) / tokens,
    }
    return weights.float(), metrics
