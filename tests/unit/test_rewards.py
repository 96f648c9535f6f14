"""Rewards: dapo_math grading cases, math_verify, user functions, and the time bound."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
import torch

from dapo_megatron.algo.rewards import RewardScorer, available_rewards, resolve_reward, score_response
from dapo_megatron.algo.rewards.dapo_math import TAIL_CHARS, normalize_answer
from dapo_megatron.algo.rewards.exact_value import exact_value

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

# The answer formats real models write (issue 11): the right value, written in a way
# DAPO's rule means to accept, and the hedges and roundings it must refuse.
REAL_MODEL_CASES = [
    # The value on the next line; a trailing empty Answer: after a complete one.
    ("Answer:\n\n$855$", "855", True, "855"),
    ("Answer: 42\nAnswer:", "42", True, "42"),
    ("Answer: 42\n\nAnswer:  \n", "42", True, "42"),
    ("Answer:\nAnswer: 7", "7", True, "7"),
    # Escaped dollars.
    ("Answer: \\$19", "19", True, "19"),
    ("Answer: $\\$386$", "386", True, "386"),
    # Units glued on or spaced with TeX spacing (which is a space, not nothing).
    ("Answer: 922cm", "922", True, "922"),
    ("Answer: $411\\text{cm}$", "411", True, "411"),
    ("Answer: $42\\,\\text{cm}$", "42", True, "42"),
    ("Answer: $338\\ \\text{cm}$", "338", True, "338"),
    ("Answer: $12\\mathrm{cm}$", "12", True, "12"),
    ("Answer: $1\\,000$", "1000", True, "1000"),
    # Prose around the value.
    ("Answer: The value is $235$.", "235", True, "235"),
    ("Answer: The answer is 42.", "42", True, "42"),
    ("Answer: 42 because 3 + 36 = 39", "42", True, "42"),
    ("Answer: 42 (as computed above)", "42", True, "42"),
    ("Answer: a total of 42 apples", "42", True, "42"),
    # End-of-sequence tokens, invisible characters, signs and decorations.
    ("Answer: 42<|im_end|>", "42", True, "42"),
    ("Answer: $\\boxed{42}$<|endoftext|>", "42", True, "42"),
    ("Answer: 42</s>", "42", True, "42"),
    ("Answer: 42\u200b", "42", True, "42"),
    ("Answer: \u22127", "-7", True, "-7"),
    ("Answer: $30^\\circ$", "30", True, "30"),
    ("Answer: 30\u00b0", "30", True, "30"),
    ("Answer: `42`", "42", True, "42"),
    ("Answer: **42**", "42", True, "42"),
    ("Answer: $\\mathbf{42}$", "42", True, "42"),
    ("Answer: \\quad 42", "42", True, "42"),
    ("Answer: 42 \\\\", "42", True, "42"),
    # Equal values written unevaluated: exact rational comparison.
    ("Answer: $\\frac{84}{2}$", "42", True, "\\frac{84}{2}"),
    ("Answer: $\\sqrt{7396}$", "86", True, "\\sqrt{7396}"),
    ("Answer: $2^{10}$", "1024", True, "2^{10}"),
    ("Answer: 0.5", "\\frac{1}{2}", True, "0.5"),
    ("Answer: $\\sqrt{7397}$", "86", False, "\\sqrt{7397}"),
    ("Answer: $\\frac{85}{2}$", "42", False, "\\frac{85}{2}"),
    # Hedges score wrong: two different boxed values, two values joined by prose.
    ("Answer: \\boxed{65} or \\boxed{351}", "65", False, "65 | 351"),
    ("Answer: $\\boxed{65}$ or $\\boxed{351}$", "351", False, "65 | 351"),
    ("Answer: \\boxed{65} = \\boxed{65}", "65", True, "65"),
    ("Answer: 42 or 43", "42", False, "42 | 43"),
    ("Answer: $x = 5$ and $y = 6$", "5", False, "5 | 6"),
    # Decimals are compared digit by digit, never rounded to equality.
    ("Answer: 0.1234567890123456789012345678", "0.123456789012345678901234567900", False, None),
    ("Answer: 0.1234567890123456789012345678", "0.12345678901234567890123456780", True, None),
    ("Answer: 3.14159", "3.1416", False, "3.14159"),
    ("Answer: no solution", "0", False, ""),
]


@pytest.mark.parametrize(("response", "truth", "correct", "prediction"), DAPO_MATH_CASES)
def test_dapo_math_cases(response, truth, correct, prediction):
    result = score_response("dapo_math", response, truth)
    assert result.correct is correct
    assert result.score == (1.0 if correct else -1.0)
    assert result.prediction == prediction
    assert not result.timed_out and result.error is None


@pytest.mark.parametrize(("response", "truth", "correct", "prediction"), REAL_MODEL_CASES)
def test_answer_formats_real_models_write(response, truth, correct, prediction):
    result = score_response("dapo_math", response, truth)
    assert result.correct is correct, result.prediction
    if prediction is not None:
        assert result.prediction == prediction


def test_exact_value_is_exact_and_bounded():
    assert exact_value("\\frac{84}{2}") == 42
    assert exact_value("\\frac12 + 0.5") == 1
    assert exact_value("2\\sqrt{9} - (1 + 2) \\cdot 4^{1/2}") == 0
    assert exact_value("\\sqrt[3]{-27}") == -3
    assert exact_value("\\left(\\frac{3}{4}\\right)^{-2}") == Fraction(16, 9)
    assert exact_value("0.1234567890123456789012345678") == Fraction(1234567890123456789012345678, 10**28)
    for unknown in ("\\sqrt{2}", "\\sqrt{-4}", "x + 1", "1/0", "2^{2^{2^{2^{2}}}}", "(" * 100 + "1" + ")" * 100, ""):
        assert exact_value(unknown) is None, unknown


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
        "y" * 1_000 + "\nAnswer: $" + "\\sqrt{" * 60 + "4" + "}" * 60 + "$",
        "y" * 1_000 + "\nAnswer: $" + "9^{" * 40 + "9" + "}" * 40 + "$",
        "y" * 1_000 + "\nAnswer: " + "\\frac{1}{" * 25 + "7" + "}" * 25,
        "y" * 1_000 + "\nAnswer: " + "$1$ or " * 40,
        "y" * 1_000 + "\nAnswer: " + "<|im_end|>" * 100 + "\u200b" * 100,
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


def test_a_reward_worker_that_dies_at_start_scores_an_error(monkeypatch):
    """A worker that exits while it starts (a crashing import) or does not come up within
    the start bound scores ``error_score``, counted in errors; ``score`` never raises. For
    a while after a failed start, calls score the same error at once instead of starting
    (and waiting for) a worker per response; then a start is tried again."""
    from dapo_megatron.algo.rewards import registry

    monkeypatch.setenv("REWARD_FIXTURE_START", "exit")
    scorer = RewardScorer("tests.unit.reward_fixtures:slow_on_marker", timeout_s=10, error_score=-0.5)
    try:
        first = scorer.score("1", "1")
        assert (first.score, first.correct, first.timed_out) == (-0.5, False, False)
        assert "reward worker for 'tests.unit.reward_fixtures:slow_on_marker' failed to start" in first.error
        assert "exit code 1" in first.error
        start = time.perf_counter()
        again = scorer.score("1", "1")
        assert time.perf_counter() - start < 0.5 and again.error == first.error and again.score == -0.5
        assert scorer.metrics() == {"calls": 2.0, "correct": 0.0, "timeouts": 0.0, "errors": 2.0}
        # Once the pause is over (here at once), a worker starts again and scores.
        monkeypatch.setattr(registry, "START_RETRY_S", 0.0)
        monkeypatch.delenv("REWARD_FIXTURE_START")
        assert scorer.score("1", "1").correct
    finally:
        scorer.close()

    monkeypatch.setenv("REWARD_FIXTURE_START", "hang")
    scorer = RewardScorer("tests.unit.reward_fixtures:slow_on_marker", timeout_s=10, start_timeout_s=0.5)
    try:
        hung = scorer.score("1", "1")
        assert hung.score == -1.0 and not hung.correct and "did not start within 0.5 s" in hung.error
        assert scorer.metrics()["errors"] == 1 and scorer._process is None  # the hung worker was killed
    finally:
        scorer.close()


def test_reward_workers_are_memory_capped():
    """A reward call that allocates past ``memory_mb`` gets a MemoryError, scored as a
    reward error; the worker lives on and scores the next responses."""
    scorer = RewardScorer("tests.unit.reward_fixtures:allocates_on_marker", timeout_s=30, memory_mb=1024)
    try:
        big = scorer.score("BIG", "1")
        assert big.score == -1.0 and not big.correct and big.error.startswith("MemoryError")
        worker = scorer._process.pid
        assert scorer.score("1", "1").correct and scorer.score("2", "1").score == -1.0
        assert scorer._process.pid == worker
        assert scorer.metrics() == {"calls": 3.0, "correct": 1.0, "timeouts": 0.0, "errors": 1.0}
    finally:
        scorer.close()


def test_unknown_rewards_are_refused_with_the_options():
    assert {"dapo_math", "math_verify"} <= set(available_rewards())
    with pytest.raises(ValueError, match="unknown reward 'dapo'; registered: dapo_math, math_verify"):
        resolve_reward("dapo")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_reward("no_such_module:fn")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        resolve_reward("tests.unit.reward_fixtures:missing")


def test_non_finite_scores_are_reward_errors_and_numpy_numbers_and_bools_are_scores():
    """A NaN or infinite score would make its group's advantages NaN (or stop the step), and
    so would a finite one too large for the group's mean and std (1e308): both are reward errors
    naming the function, scored ``error_score``; a score at the bound, NumPy numbers and
    bools are scores."""
    import math

    from dapo_megatron.algo import group_advantages_by_id
    from dapo_megatron.algo.rewards.pool import RewardPool
    from dapo_megatron.algo.rewards.registry import MAX_ABS_SCORE

    with pytest.raises(ValueError, match="NaN or Inf"):  # what a 1e308 reward would do to its step
        group_advantages_by_id(torch.tensor([1e308, 1e308, -1e308, 0.0]), [0] * 4)
    pool = RewardPool("tests.unit.reward_fixtures:returns_by_request", 10, 1, error_score=-0.5)
    try:
        asks = ["nan", "inf", "np_nan", "huge", "neg_huge", "np_float", "np_int", "true", "np_false"]
        asks += ["at_bound", "neg_at_bound"]
        results = pool.score(asks, ["x"] * len(asks))
        assert pool.local.metrics()["errors"] == 5
    finally:
        pool.close()
    scores = [r.score for r in results]
    assert MAX_ABS_SCORE == 1e6
    assert scores == [-0.5, -0.5, -0.5, -0.5, -0.5, 1.0, -1.0, 1.0, 0.0, 1e6, -1e6]
    assert [r.error is not None for r in results] == [True] * 5 + [False] * 6
    assert "non-finite score nan" in results[0].error and "non-finite score -inf" in results[1].error
    assert "the score 1e+308, which is beyond ±1e+06" in results[3].error
    assert "the score -1e+308, which is beyond ±1e+06" in results[4].error
    assert [r.correct for r in results] == [False] * 5 + [True, False, True, False, True, False]
    advantages = group_advantages_by_id(torch.tensor(scores), [0] * len(scores))
    assert all(math.isfinite(a) for a in advantages.tolist())
