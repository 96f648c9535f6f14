"""The DAPO algorithm as pure torch/Python: no process groups, no ranks, no Megatron.

The actor, the trainer and the benchmarks call these functions; distributed concerns
(global token counts) come in as plain numbers.

The names below are imported on first use (PEP 562), not when the package is: a reward
worker imports :mod:`dapo_megatron.algo.rewards`, which runs this file, and must not pay
for torch (about a second per worker start, and again after every reward timeout).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dapo_megatron.algo.advantages import group_advantages, group_advantages_by_id
    from dapo_megatron.algo.dynamic_sampling import DynamicSamplingAccumulator, DynamicSamplingExhausted
    from dapo_megatron.algo.loss import LOSS_AGG_MODES, dapo_policy_loss
    from dapo_megatron.algo.overlong import overlong_filter_mask, overlong_penalty
    from dapo_megatron.algo.rewards import RewardResult, RewardScorer, register_reward, score_response

_HOMES = {
    "group_advantages": "advantages",
    "group_advantages_by_id": "advantages",
    "DynamicSamplingAccumulator": "dynamic_sampling",
    "DynamicSamplingExhausted": "dynamic_sampling",
    "LOSS_AGG_MODES": "loss",
    "dapo_policy_loss": "loss",
    "overlong_filter_mask": "overlong",
    "overlong_penalty": "overlong",
    "RewardResult": "rewards",
    "RewardScorer": "rewards",
    "register_reward": "rewards",
    "score_response": "rewards",
}

__all__ = [
    "LOSS_AGG_MODES",
    "DynamicSamplingAccumulator",
    "DynamicSamplingExhausted",
    "RewardResult",
    "RewardScorer",
    "dapo_policy_loss",
    "group_advantages",
    "group_advantages_by_id",
    "overlong_filter_mask",
    "overlong_penalty",
    "register_reward",
    "score_response",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
