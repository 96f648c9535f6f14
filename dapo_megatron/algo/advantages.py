"""Group-relative advantages: GRPO's and DAPO's critic-free baseline.

Each prompt is sampled ``group_size`` times; a response's advantage is its reward minus
the group mean, divided by the group standard deviation (plus ``eps``). Every token of a
response shares its advantage. Groups with equal rewards get zero advantage everywhere,
which is why dynamic sampling drops them.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantages ``(R - mean) / (std + eps)`` within consecutive groups.

    Args:
        rewards: ``[num_prompts * group_size]`` rewards; responses of one prompt are
            consecutive.
        group_size: responses per prompt (G); at least 2.
        eps: added to the standard deviation so equal-reward groups give 0, not NaN.

    Returns:
        ``[num_prompts * group_size]`` advantages, in ``rewards``' dtype. ``std`` is the
        unbiased estimate, as ``torch.std`` computes it by default.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor [num_prompts * group_size], got {shape}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (a standard deviation needs two samples), got {group_size!r}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}, which is not a whole number of groups of "
            f"group_size={group_size}"
        )
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"rewards (shape {tuple(rewards.shape)}) contains NaN or Inf")
    grouped = rewards.reshape(-1, group_size)  # [num_prompts, group_size]
    mean = grouped.mean(dim=-1, keepdim=True)
    std = grouped.std(dim=-1, keepdim=True)
    return ((grouped - mean) / (std + eps)).reshape(-1)


def group_advantages_by_id(rewards: torch.Tensor, group_ids: list, eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantages with groups formed by identity, in any order.

    ``group_ids[i]`` names the group (the prompt) of response ``i``; responses of a group
    need not be consecutive and the result does not depend on the order of the batch.
    Each group's advantages are :func:`group_advantages` of its rewards.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or rewards.numel() != len(group_ids):
        raise ValueError(
            f"rewards must be a 1-D tensor with one entry per group id; got shape "
            f"{tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else None} and {len(group_ids)} ids"
        )
    members: dict = {}
    for index, group in enumerate(group_ids):
        members.setdefault(group, []).append(index)
    sizes = {len(rows) for rows in members.values()}
    if len(sizes) != 1:
        raise ValueError(
            f"groups have different sizes {sorted(sizes)}; every prompt needs the same number of responses"
        )
    (size,) = sizes
    order = torch.tensor([i for rows in members.values() for i in rows])  # groups made consecutive
    advantages = torch.empty_like(rewards)
    advantages[order] = group_advantages(rewards[order], size, eps)
    return advantages
