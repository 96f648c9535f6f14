"""``math_verify``: free-form LaTeX answers checked with the math-verify library.

For data sets whose answers are expressions (fractions, radicals, intervals) rather than
integers. math-verify parses both sides with sympy and compares them symbolically. Its
own timeouts use ``signal.alarm`` (main thread only), so they are turned off here and the
call is bounded by the reward runner instead, which runs this function in a worker
process it can kill.
"""

from __future__ import annotations

from dapo_megatron.algo.rewards.base import RewardResult, register_reward


@register_reward("math_verify", bounded=False)
def math_verify_reward(response: str, ground_truth: str) -> RewardResult:
    """+1 when math-verify finds the response's answer equivalent to the ground truth."""
    from math_verify import parse, verify

    gold = parse(_as_latex(str(ground_truth)), parsing_timeout=None)
    predicted = parse(response, parsing_timeout=None)
    if not predicted:
        return RewardResult(score=-1.0, correct=False, prediction=None)
    correct = bool(gold) and bool(verify(gold, predicted, timeout_seconds=None))
    prediction = str(predicted[-1]) if predicted else None
    return RewardResult(score=1.0 if correct else -1.0, correct=correct, prediction=prediction)


def _as_latex(answer: str) -> str:
    """math-verify finds answers inside math delimiters; bare ground truths get them."""
    stripped = answer.strip()
    if stripped.startswith("$") or "\\boxed" in stripped or stripped.startswith("\\("):
        return stripped
    return f"${stripped}$"
