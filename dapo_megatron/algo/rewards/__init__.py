"""Rule-based rewards, by name: ``dapo_math`` (DAPO-Math grading), ``math_verify``
(symbolic LaTeX equivalence), or a user's ``module:function``; every call time-bounded."""

from dapo_megatron.algo.rewards.base import RewardResult, register_reward
from dapo_megatron.algo.rewards.registry import RewardScorer, available_rewards, resolve_reward, score_response

__all__ = [
    "RewardResult",
    "RewardScorer",
    "available_rewards",
    "register_reward",
    "resolve_reward",
    "score_response",
]
