"""Reward functions the end-to-end tests name as ``module:function``."""


def always_right(response: str, ground_truth: str) -> float:
    """Every response right: every group has equal rewards, dynamic sampling keeps none."""
    return 1.0


def mixed_for_even_answers(response: str, ground_truth: str) -> float:
    """Prompts with an odd answer: all wrong (their groups are dropped). Even answers:
    right when the response text has an even length (mixed groups)."""
    if int(ground_truth) % 2:
        return -1.0
    return 1.0 if len(response) % 2 == 0 else -1.0
