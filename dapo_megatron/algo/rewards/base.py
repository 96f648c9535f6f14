"""What a reward function returns (:class:`RewardResult`) and the names they are
registered under (:func:`register_reward`).

Apart from :mod:`registry` (which resolves names and runs the functions) so that the
built-in rewards can register themselves without importing the module that imports
them: the registry imports them, they import this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class RewardResult:
    """The outcome of scoring one response."""

    score: float
    """Reward: +1 correct, -1 wrong for the built-in functions."""
    correct: bool
    """Whether the response's answer matched the ground truth."""
    prediction: Optional[str]
    """The answer extracted from the response (normalised), or None if none was found."""
    timed_out: bool = False
    """The call exceeded the time bound and was scored as wrong."""
    error: Optional[str] = None
    """The reward function raised (or returned something unusable); scored as wrong."""


RewardFn = Callable[[str, str], Any]


@dataclass(frozen=True)
class Registered:
    """A registered reward function and whether its running time is bounded."""

    fn: RewardFn
    """The function."""
    bounded: bool
    """Its running time is bounded by construction (it runs in-process)."""


REGISTRY: dict[str, Registered] = {}
"""Reward functions by registered name."""


def register_reward(name: str, *, bounded: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``.

    ``bounded=True`` promises that the function's running time is bounded whatever the
    input (it then runs in-process); otherwise it runs in a killable worker process.
    """

    def decorate(fn: RewardFn) -> RewardFn:
        REGISTRY[name] = Registered(fn, bounded)
        return fn

    return decorate
