"""DAPO's policy loss: decoupled clip, optional dual clip, token-level aggregation.

The per-token objective is PPO's clipped surrogate with separate lower and upper bounds
(Clip-Higher: ``clip_ratio_low=0.2``, ``clip_ratio_high=0.28``), optionally capped for
negative advantages by the dual clip ``clip_ratio_c``. The aggregation is what DAPO is
about: ``token-mean`` divides the summed token losses by the number of response tokens of
the *whole* mini-batch, so a long response weighs in proportion to its length. In the
distributed case the caller passes that count as ``global_num_tokens`` (all-reduced over
micro-batches and data-parallel ranks); then the sum of every micro-batch's loss is
exactly the single-process token mean, and so are the gradients. ``seq-mean-token-mean``
(GRPO's per-sample mean) and ``seq-mean-token-sum`` are kept for ablations.

DAPO drops GRPO's KL penalty to a reference policy; GRPO-style runs keep it. With
``ref_log_probs`` the loss adds ``kl_coef`` times the per-token estimate of
KL(π_θ ‖ π_ref) (:func:`kl_penalty`), aggregated as the policy loss is (same
denominator), never weighted by the rollout correction.
"""

from __future__ import annotations

from typing import Optional

import torch

from dapo_megatron.algo._checks import require_2d, require_finite_where, require_same_shape

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_TYPES = ("k1", "k3", "low_var_kl")

# exp() of a log-ratio beyond this overflows float32 soon after. Bounding it keeps inf
# out of the loss, and gives a token beyond the bound zero gradient: for A > 0 (ratio too
# high) and A < 0 (ratio too low) the clip already did, but a token with A < 0 and a
# ratio above e^20 (no dual clip) or with A > 0 and a ratio below e^-20 loses a gradient
# the unclipped objective would have. Such tokens are counted in ``log_ratio_clamped``.
_MAX_ABS_LOG_RATIO = 20.0


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from the sampled tokens' log-probs (the
    tokens were sampled from the rollout policy, ≈ π_θ), ``[batch, seq]``:

    - ``k1``: ``log π_θ - log π_ref`` (unbiased, can be negative; its gradient is the
      score function times one, i.e. it pushes every sampled token's log-prob down);
    - ``k3``: ``exp(log π_ref - log π_θ) - (log π_ref - log π_θ) - 1`` (unbiased, >= 0,
      lower variance; Schulman's k3), with the log-ratio bounded at ±20;
    - ``low_var_kl``: ``k3`` with each token's value clamped to [-10, 10] (as verl does),
      so that one token whose probability collapsed cannot dominate.
    """
    if kind not in KL_TYPES:
        raise ValueError(f"kl type {kind!r} is not one of {', '.join(KL_TYPES)}")
    log_ratio = ref_log_probs.to(log_probs.dtype) - log_probs  # log(π_ref / π_θ)
    if kind == "k1":
        return -log_ratio
    log_ratio = log_ratio.clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)
    k3 = torch.exp(log_ratio) - log_ratio - 1.0
    return k3.clamp(-10.0, 10.0) if kind == "low_var_kl" else k3


def dapo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[int | torch.Tensor] = None,
    global_num_seqs: Optional[int | torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_type: str = "low_var_kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DAPO clipped policy-gradient loss (to minimise) and its metrics.

    Args:
        log_probs: ``[batch, seq]`` log-probs of the sampled tokens under the current policy
            (requires grad).
        old_log_probs: ``[batch, seq]`` log-probs under the policy that sampled them.
        advantages: ``[batch]`` or ``[batch, seq]`` advantages.
        response_mask: ``[batch, seq]``, 1 (or True) at response tokens that count.
        clip_ratio_low: ratios below ``1 - clip_ratio_low`` are clipped (negative advantage).
        clip_ratio_high: ratios above ``1 + clip_ratio_high`` are clipped (positive advantage).
        clip_ratio_c: dual-clip bound (> 1): for negative advantages the token loss is at
            most ``-A * clip_ratio_c``. ``None`` disables it.
        loss_agg_mode: ``token-mean`` (DAPO), ``seq-mean-token-mean`` (GRPO) or
            ``seq-mean-token-sum``.
        global_num_tokens: ``token-mean`` denominator: response tokens of the whole
            mini-batch across micro-batches and data-parallel ranks. Default: this batch's
            ``response_mask.sum()``. With it, this batch's mask may be empty.
        global_num_seqs: denominator of the ``seq-mean-*`` modes, likewise; default: the
            rows of this batch that have response tokens.
        token_weights: ``[batch, seq]`` constant weights of the token losses (the rollout
            correction, :mod:`rollout_correction`); no gradient flows through them and the
            denominators are unchanged (a weight of 0 drops a token's contribution only).
        ref_log_probs: ``[batch, seq]`` log-probs under the reference policy: adds
            ``kl_coef`` x :func:`kl_penalty` of ``kl_type``, aggregated like the policy
            loss (not weighted by ``token_weights``).

    Returns:
        ``(loss, metrics)``. ``metrics`` holds detached 0-d tensors over this batch's
        response tokens: ``pg_clipfrac_low`` / ``pg_clipfrac_high`` (fraction of tokens whose
        gradient is cut by the lower / upper bound), ``pg_clipfrac_dual``, ``approx_kl``
        (the k3 estimate of KL(old || new), ``r - 1 - log r``), ``ratio_mean``,
        ``ratio_max``, ``log_ratio_clamped`` (fraction of tokens whose |log-ratio| exceeds 20
        and is bounded there, which zeroes their gradient; see ``_MAX_ABS_LOG_RATIO``),
        ``kl_loss`` (the mean KL estimate per token, 0 without ``ref_log_probs``) and
        ``num_tokens``.
    """
    require_2d("log_probs", log_probs)
    require_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, response_mask=response_mask)
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if advantages.dim() == 1:
        if advantages.shape[0] != log_probs.shape[0]:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)} but log_probs has shape "
                f"{tuple(log_probs.shape)}; a 1-D advantages needs one value per row"
            )
        advantages = advantages.unsqueeze(-1).expand_as(log_probs)
    else:
        require_same_shape("log_probs", log_probs, advantages=advantages)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    if not 0 <= clip_ratio_low < 1 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low={clip_ratio_low} must be in [0, 1) and clip_ratio_high={clip_ratio_high} >= 0"
        )
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1")

    mask = response_mask.bool()
    num_tokens = mask.sum()
    require_finite_where("log_probs", log_probs, mask)
    require_finite_where("old_log_probs", old_log_probs, mask)
    require_finite_where("advantages", advantages, mask)

    # Padding may hold anything (even NaN): zero it before it meets a product.
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    raw_log_ratio = torch.where(mask, log_probs - old_log_probs.to(log_probs.dtype), zero)
    log_ratio = raw_log_ratio.clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)
    adv = torch.where(mask, advantages.to(log_probs.dtype), zero)
    ratio = torch.exp(log_ratio)  # [batch, seq]

    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)  # pessimistic bound, as in PPO
    if clip_ratio_c is not None:
        capped = torch.minimum(per_token, -adv * clip_ratio_c)
        per_token = torch.where(adv < 0, capped, per_token)
    maskf = mask.to(per_token.dtype)
    per_token = per_token * maskf  # [batch, seq]
    if token_weights is not None:
        require_same_shape("log_probs", log_probs, token_weights=token_weights)
        require_finite_where("token_weights", token_weights, mask)
        per_token = per_token * torch.where(mask, token_weights.detach().to(per_token.dtype), zero)

    def aggregate(values: torch.Tensor) -> torch.Tensor:  # [batch, seq], zero outside the mask
        if loss_agg_mode == "token-mean":
            denominator = num_tokens if global_num_tokens is None else global_num_tokens
            _require_positive(
                "global_num_tokens" if global_num_tokens is not None else "response_mask", denominator, mask
            )
            return values.sum() / denominator
        seq_tokens = maskf.sum(dim=-1)  # [batch]
        seq_loss = values.sum(dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_loss = seq_loss / seq_tokens.clamp(min=1)
        denominator = (seq_tokens > 0).sum() if global_num_seqs is None else global_num_seqs
        _require_positive("global_num_seqs" if global_num_seqs is not None else "response_mask", denominator, mask)
        return seq_loss.sum() / denominator

    loss = aggregate(per_token)
    kl = torch.zeros_like(per_token)
    if ref_log_probs is not None:
        require_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs)
        require_finite_where("ref_log_probs", ref_log_probs, mask)
        kl = torch.where(mask, kl_penalty(log_probs, torch.where(mask, ref_log_probs, zero), kl_type), zero)
        loss = loss + kl_coef * aggregate(kl)

    with torch.no_grad():
        count = num_tokens.clamp(min=1).to(per_token.dtype)
        neg, pos = adv < 0, adv > 0
        clip_low = mask & neg & (ratio < 1.0 - clip_ratio_low)
        clip_high = mask & pos & (ratio > 1.0 + clip_ratio_high)
        dual = mask & neg & (ratio > clip_ratio_c) if clip_ratio_c is not None else torch.zeros_like(mask)
        metrics = {
            "pg_clipfrac_low": clip_low.sum() / count,
            "pg_clipfrac_high": clip_high.sum() / count,
            "pg_clipfrac_dual": dual.sum() / count,
            "approx_kl": ((ratio - 1.0 - log_ratio) * maskf).sum() / count,
            "ratio_mean": (ratio * maskf).sum() / count,
            "ratio_max": torch.where(mask, ratio, zero).max() if bool(mask.any()) else zero.clone(),
            "log_ratio_clamped": (mask & (raw_log_ratio.detach().abs() > _MAX_ABS_LOG_RATIO)).sum() / count,
            "kl_loss": kl.detach().sum() / count,
            "num_tokens": num_tokens.detach(),
        }
    return loss, metrics


def _require_positive(name: str, denominator, mask: torch.Tensor) -> None:
    value = denominator.item() if isinstance(denominator, torch.Tensor) else denominator
    if value <= 0:
        if name == "response_mask":
            raise ValueError(
                f"response_mask (shape {tuple(mask.shape)}) selects no response tokens; the loss would be 0/0. "
                "Pass global_num_tokens / global_num_seqs when this batch is one piece of a larger one"
            )
        raise ValueError(f"{name}={value} must be > 0")
