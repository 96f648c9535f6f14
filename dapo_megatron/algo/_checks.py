"""Input checks shared by the algorithm functions: clear ValueErrors that name the
argument and the shapes seen, instead of a broadcasting surprise deep in the loss."""

from __future__ import annotations

import torch


def require_2d(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [batch, seq], got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"{name} must have shape [batch, seq], got shape {tuple(tensor.shape)}")


def require_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, tensor in others.items():
        require_2d(name, tensor)
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape {tuple(reference.shape)}; "
                "they must match"
            )


def require_finite_where(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> None:
    """NaN/Inf inside the mask poisons the loss; outside it (padding) anything is allowed."""
    bad = ~torch.isfinite(tensor) & mask
    if bool(bad.any()):
        rows = torch.nonzero(bad.any(dim=-1)).flatten().tolist()
        raise ValueError(
            f"{name} (shape {tuple(tensor.shape)}) has {int(bad.sum())} NaN/Inf values at response "
            f"tokens, in rows {rows[:8]}{'...' if len(rows) > 8 else ''}"
        )
