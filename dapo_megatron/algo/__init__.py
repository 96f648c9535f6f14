"""The DAPO algorithm as pure torch/Python: no process groups, no ranks, no Megatron.

The actor, the trainer and the benchmarks call these functions; distributed concerns
(global token counts) come in as plain numbers.
"""

from dapo_megatron.algo.advantages import group_advantages, group_advantages_by_id
from dapo_megatron.algo.dynamic_sampling import DynamicSamplingAccumulator, DynamicSamplingExhausted
from dapo_megatron.algo.loss import LOSS_AGG_MODES, dapo_policy_loss
from dapo_megatron.algo.overlong import overlong_filter_mask, overlong_penalty
from dapo_megatron.algo.rewards import RewardResult, RewardScorer, register_reward, score_response

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
