"""Rewards: dapo_math grading cases, math_verify, user functions, and the time bound."""

from __future__ import annotations

import time

import pytest

from dapo_megatron.algo.rewards import RewardScorer, available_rewards, resolve_reward, score_response
from dapo_megatron.algo.rewards.dapo_math import TAIL_CHARS, normalize_answer

FILLER = "Let me think about this step by step. " * 20

# (response, ground truth, correct, prediction)
DAPO_MATH_CASES = [
    ("Answer: 42", "42", True, "42"),
    (f"{FILLER}\nAnswer: 42", "42", True, "42"),
    ("Answer: 41", "42", False, "41"),
    ("Answer: -7", "-7", True, "-7"),
    ("Answer: +7", "7", True, "7"),
    ("Answer: 007", "7", True, "7"),
    ("Answer: 5.0", "5", True, "5"),
    ("Answer: 2.50", "2.5", True, "2.5"),
    ("Answer: 0", "0", True, "0"),
    ("Answer: \\boxed{42}", "42", True, "42"),
    ("Answer: $\\boxed{42}$", "42", True, "42"),
    ("Answer: $42$", "42", True, "42"),
    ("Answer: $$42$$", "42", True, "42"),
    ("Answer: \\(42\\)", "42", True, "42"),
    ("Answer: 1,234", "1234", True, "1234"),
    ("Answer: $1,234,567$", "1234567", True, "1234567"),
    ("Answer: 1{,}000", "1000", True, "1000"),
    ("Answer: 1, 2", "12", False, "1,2"),
    ("Answer: 12 cm", "12", True, "12"),
    ("Answer: 30 degrees", "30", True, "30"),
    ("Answer: $30^\\circ$", "30", True, "30"),
    ("Answer: 50\\%", "50", True, "50"),
    ("Answer: 12 square feet", "12", True, "12"),
    ("Answer: \\text{12 dollars}", "12", True, "12"),
    ("Answer: $\\text{12}$", "12", True, "12"),
    ("Answer: 42.", "42", True, "42"),
    ("Answer:   4 2  ", "42", True, "42"),
    ("Answer: x = 5", "5", True, "5"),
    ("answer: 42", "42", True, "42"),
    ("**Answer:** 42", "42", True, "42"),
    ("Answer: $\\dfrac{1}{2}$", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: 3\nAnswer: 4", "4", True, "4"),
    ("Answer: 4\nAnswer: 3", "4", False, "3"),
    ("Answer: 4\nThe rest of the text without a final answer line.", "4", True, "4"),
    ("The answer is 42.", "42", False, None),
    ("", "42", False, None),
    ("Answer:", "42", False, None),
    ("Answer: \\boxed{}", "0", False, ""),
    (f"Answer: 42\n{FILLER}", "42", False, None),  # far from the end: out of the graded tail
    ("Answer: 10 ways", "10", True, "10"),
    ("Answer: 12 \\text{ cm}^2", "12", True, "12"),
]


@pytest.mark.parametrize(("response", "truth", "correct", "prediction"), DAPO_MATH_CASES)
def test_dapo_math_cases(response, truth, correct, prediction):
    result = score_response("dapo_math", response, truth)
    assert result.correct is correct
    assert result.score == (1.0 if correct else -1.0)
    assert result.prediction == prediction
    assert not result.timed_out and result.error is None


def test_there_are_at_least_30_cases():
    assert len(DAPO_MATH_CASES) >= 30


def test_normalize_answer_examples():
    assert normalize_answer("$\\boxed{1,000}$.") == "1000"
    assert normalize_answer("\\textbf{\\text{7}}") == "7"
    assert normalize_answer("-0.0") == "0"
    assert normalize_answer("\\frac{3}{4}") == "\\frac{3}{4}"


@pytest.mark.parametrize(
    "response",
    [
        "A" * 20_000,
        "Answer:" * 3_000,
        "\\boxed{" * 3_000 + "1",
        "{" * 10_000 + "Answer: \\boxed{" + "{" * 280,
        ("1," * 10_000) + "\nAnswer: " + "1," * 140 + "1",
        "Answer: " + "\\text{" * 50 + "1" + "}" * 50,
        "x" * 19_980 + "\nAnswer: 42",
        # Overlapping unit words ("m", "mm") once made a repeated regex group backtrack exponentially.
        "y" * 1_000 + "\nAnswer: 1" + "m" * 280 + "x",
        "y" * 1_000 + "\nAnswer: 1" + " m" * 140,
        "y" * 1_000 + "\nAnswer: " + "1" * 280 + "x",
    ],
)
def test_adversarial_inputs_are_fast(response):
    assert len(response) >= 300
    start = time.perf_counter()
    for _ in range(100):
        score_response("dapo_math", response, "42")
    # Bounded work on a fixed-size tail: 100 calls take well under a second.
    assert time.perf_counter() - start < 1.0


def test_long_response_with_answer_at_the_end_is_graded():
    response = "x" * 19_980 + "\nAnswer: 42"
    assert score_response("dapo_math", response, "42").correct
    assert TAIL_CHARS == 300


def test_math_verify_free_form_latex():
    scorer = RewardScorer("math_verify", timeout_s=30)
    try:
        results, metrics = scorer.score_batch(
            [
                "The answer is $\\boxed{\\frac{1}{2}}$",
                "So we get $\\boxed{0.5}$.",
                "It is $\\boxed{\\sqrt{2}}$",
                "no idea",
            ],
            ["\\frac{1}{2}", "1/2", "\\frac{1}{2}", "3"],
        )
    finally:
        scorer.close()
    assert [r.correct for r in results] == [True, True, False, False]
    assert metrics["accuracy"] == 0.5 and metrics["timeouts"] == 0


def test_user_function_by_module_path():
    result = score_response("tests.unit.reward_fixtures:returns_dict", "abcdef", "x")
    assert result.score == 0.5 and result.correct and result.prediction == "abc"


def test_time_bound_scores_wrong_and_counts_and_recovers():
    scorer = RewardScorer("tests.unit.reward_fixtures:slow_on_marker", timeout_s=1.0)
    try:
        assert scorer.score("42", "42").correct
        start = time.perf_counter()
        stuck = scorer.score("SLOW 42", "42")
        assert time.perf_counter() - start < 5.0
        assert stuck.timed_out and not stuck.correct and stuck.score == -1.0
        # The stuck worker was killed; the next call gets a fresh one.
        assert scorer.score("42", "42").correct
        metrics = scorer.metrics()
        assert metrics == {"calls": 3.0, "correct": 2.0, "timeouts": 1.0, "errors": 0.0}
    finally:
        scorer.close()


def test_a_hanging_function_cannot_hang_score_response():
    start = time.perf_counter()
    result = score_response("tests.unit.reward_fixtures:hangs", "1", "1", timeout_s=0.5)
    assert result.timed_out and time.perf_counter() - start < 5.0


def test_raising_and_misbehaving_functions_score_wrong_and_count():
    scorer = RewardScorer("tests.unit.reward_fixtures:raises", timeout_s=10)
    try:
        result = scorer.score("a", "b")
        assert not result.correct and result.score == -1.0 and "KeyError" in result.error
        assert scorer.metrics()["errors"] == 1
    finally:
        scorer.close()
    odd = score_response("tests.unit.reward_fixtures:returns_string", "a", "b", timeout_s=10)
    assert odd.error is not None and "expected a number" in odd.error


def test_unknown_rewards_are_refused_with_the_options():
    assert {"dapo_math", "math_verify"} <= set(available_rewards())
    with pytest.raises(ValueError, match="unknown reward 'dapo'; registered: dapo_math, math_verify"):
        resolve_reward("dapo")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_reward("no_such_module:fn")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        resolve_reward("tests.unit.reward_fixtures:missing")
