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


def faulty(response: str, ground_truth: str) -> float:
    """Answer 3: raises; answer 4: hangs past any time bound; others as
    :func:`mixed_for_even_answers`."""
    import time

    if ground_truth == "3":
        raise ValueError("a reward that fails")
    if ground_truth == "4":
        time.sleep(30)
    return mixed_for_even_answers(response, ground_truth)
