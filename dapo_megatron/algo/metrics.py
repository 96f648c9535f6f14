"""Metrics over token tensors that the trainer logs every step."""

from __future__ import annotations

import torch


def rollout_consistency(
    actor_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's sampling log-probs are from the actor's on the same tokens.

    Both are ``log_softmax(logits / temperature)`` at the sampled tokens, ``[batch, seq]``;
    a gap means the two implementations (kernels, precision, a weight-sync bug) disagree,
    which biases the importance ratio. Returns the mean and max absolute difference over
    the response tokens.
    """
    if not (actor_log_probs.shape == engine_log_probs.shape == response_mask.shape):
        raise ValueError(
            f"actor_log_probs {tuple(actor_log_probs.shape)}, engine_log_probs {tuple(engine_log_probs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have the same shape"
        )
    mask = response_mask.bool()
    if not bool(mask.any()):
        raise ValueError(f"response_mask (shape {tuple(mask.shape)}) selects no tokens")
    diff = (actor_log_probs.double() - engine_log_probs.double()).abs()[mask]
    return {"logprob_diff_mean": float(diff.mean()), "logprob_diff_max": float(diff.max())}
