"""DAPO's two answers to truncated responses: soft punishment and filtering.

A response cut off at the maximum length has a reward that says little about its
reasoning. DAPO adds a length penalty that ramps from 0 to -1 over the last
``overlong_buffer_len`` tokens before ``max_response_length`` (soft overlong punishment),
and can instead mask truncated responses out of the loss (overlong filtering).
"""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Soft overlong punishment ``R_length`` of DAPO, times ``penalty_factor``.

    ``0`` up to ``L_max - L_cache`` tokens, then ``((L_max - L_cache) - |y|) / L_cache``
    down to ``-1`` at ``L_max``, and ``-1`` beyond it.

    Args:
        response_lengths: ``[batch]`` response lengths in tokens.
        max_response_length: ``L_max``.
        overlong_buffer_len: ``L_cache``, with ``0 < L_cache <= L_max``.
        penalty_factor: scale of the penalty.

    Returns:
        ``[batch]`` float penalties (``<= 0``), to be added to the correctness reward.
    """
    if not isinstance(response_lengths, torch.Tensor) or response_lengths.dim() != 1:
        shape = tuple(response_lengths.shape) if isinstance(response_lengths, torch.Tensor) else None
        raise ValueError(f"response_lengths must be a 1-D tensor [batch], got shape {shape}")
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len={overlong_buffer_len} must be in (0, max_response_length={max_response_length}]"
        )
    if bool((response_lengths < 0).any()):
        raise ValueError("response_lengths must be >= 0")
    expected = max_response_length - overlong_buffer_len
    lengths = response_lengths.to(torch.float64)
    ramp = (expected - lengths) / overlong_buffer_len  # [batch]
    penalty = torch.clamp(ramp, min=-1.0, max=0.0)
    return (penalty * penalty_factor).to(torch.float32)


def overlong_filter_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """``response_mask`` with the rows of truncated responses zeroed (overlong filtering).

    Args:
        response_mask: ``[batch, seq]`` 1 at response tokens.
        truncated: ``[batch]`` bool, True where generation stopped at the length limit.
    """
    if response_mask.dim() != 2 or truncated.dim() != 1 or truncated.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"response_mask must be [batch, seq] and truncated [batch]; got {tuple(response_mask.shape)} "
            f"and {tuple(truncated.shape)}"
        )
    keep = (~truncated.bool()).to(response_mask.dtype).unsqueeze(-1)  # [batch, 1]
    return response_mask * keep
