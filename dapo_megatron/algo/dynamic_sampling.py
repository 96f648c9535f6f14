"""Dynamic sampling: fill a batch with prompts whose responses disagree.

A group whose responses are all right (or all wrong) has zero advantage and gives no
gradient, yet still costs a slot in the batch. DAPO over-samples and keeps only groups
with mixed rewards until the batch holds ``train_batch_size`` prompts. The accumulator
below does the bookkeeping across generation rounds, trims the surplus, and fails with a
message that says what happened and which setting to change when the bound on rounds is
reached, instead of looping forever or training on a silently smaller batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class DynamicSamplingExhausted(RuntimeError):
    """The batch could not be filled within ``max_num_gen_batches`` generation rounds."""


@dataclass
class _Group:
    items: list[Any]
    rewards: torch.Tensor  # [group_size]


@dataclass
class DynamicSamplingAccumulator:
    """Collects generated groups over rounds; keeps those whose rewards are not all equal.

    Use: ``add(items, rewards)`` after each generation round, then, once ``is_full``,
    ``take()`` the batch. ``items`` and ``rewards`` hold ``num_groups * group_size``
    entries, groups consecutive. The rewards compared should be what makes a group
    informative (DAPO compares correctness: ``0 < #correct < G``).
    """

    train_batch_size: int
    """Prompts (groups) the batch needs."""
    group_size: int
    """Responses per prompt."""
    max_num_gen_batches: int = 0
    """Generation rounds allowed before giving up; 0 = unlimited."""
    filter_groups: bool = True
    """False keeps every group (dynamic sampling off): the first round fills the batch."""
    _kept: list[_Group] = field(default_factory=list, init=False, repr=False)
    _generated: int = field(default=0, init=False)
    _rounds: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.train_batch_size < 1 or self.group_size < 1:
            raise ValueError(f"train_batch_size={self.train_batch_size} and group_size={self.group_size} must be >= 1")
        if self.max_num_gen_batches < 0:
            raise ValueError(f"max_num_gen_batches={self.max_num_gen_batches} must be >= 0 (0 = unlimited)")

    @property
    def num_kept(self) -> int:
        """Groups kept so far (before trimming)."""
        return len(self._kept)

    @property
    def is_full(self) -> bool:
        """Whether enough groups are kept to form the batch."""
        return len(self._kept) >= self.train_batch_size

    def add(self, items: Sequence[Any], rewards: torch.Tensor | Sequence[float]) -> None:
        """Add one generation round of groups.

        Raises:
            ValueError: lengths disagree or are not a whole number of groups.
            DynamicSamplingExhausted: this round was the last one allowed and the batch is
                still not full.
        """
        rewards = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
        if len(items) != rewards.numel():
            raise ValueError(f"items has {len(items)} entries but rewards has shape {tuple(rewards.shape)}")
        if rewards.numel() % self.group_size:
            raise ValueError(
                f"rewards has shape {tuple(rewards.shape)}, not a whole number of groups of group_size={self.group_size}"
            )
        self._rounds += 1
        for start in range(0, rewards.numel(), self.group_size):
            group_rewards = rewards[start : start + self.group_size]
            self._generated += 1
            if self.filter_groups and bool((group_rewards == group_rewards[0]).all()):
                continue
            self._kept.append(_Group(list(items[start : start + self.group_size]), group_rewards))
        if not self.is_full and self.max_num_gen_batches and self._rounds >= self.max_num_gen_batches:
            raise DynamicSamplingExhausted(self._exhausted_message())

    def _exhausted_message(self) -> str:
        ratio = self.num_kept / self._generated if self._generated else 0.0
        return (
            f"dynamic sampling could not fill the batch: after {self._rounds} generation rounds "
            f"(algorithm.max_num_gen_batches={self.max_num_gen_batches}), {self._generated} groups were "
            f"generated and {self.num_kept} kept (keep ratio {ratio:.1%}), but data.train_batch_size="
            f"{self.train_batch_size} are needed. Raise algorithm.max_num_gen_batches (0 = unlimited) or "
            f"data.gen_batch_size to generate more per round; a keep ratio this low also means the prompts "
            f"are too easy or too hard for the model"
        )

    def metrics(self) -> dict[str, float]:
        """``generated`` and ``kept`` groups and generation ``rounds`` so far, and the keep ratio."""
        return {
            "generated": float(self._generated),
            "kept": float(self.num_kept),
            "rounds": float(self._rounds),
            "keep_ratio": self.num_kept / self._generated if self._generated else 0.0,
        }

    def take(self) -> tuple[list[Any], torch.Tensor, dict[str, float]]:
        """The batch: ``train_batch_size`` groups' items and rewards, surplus trimmed.

        Returns ``(items, rewards, metrics)`` with ``items`` flat (groups consecutive) and
        ``rewards`` ``[train_batch_size * group_size]``; ``metrics`` adds ``trimmed``. The
        accumulator is reset for the next batch.
        """
        if not self.is_full:
            raise RuntimeError(
                f"take() before the batch is full: {self.num_kept} of {self.train_batch_size} groups kept"
            )
        metrics = self.metrics()
        batch = self._kept[: self.train_batch_size]
        metrics["trimmed"] = float(len(self._kept) - len(batch))
        items = [item for group in batch for item in group.items]
        rewards = torch.cat([group.rewards for group in batch])
        self._kept, self._generated, self._rounds = [], 0, 0
        return items, rewards, metrics
