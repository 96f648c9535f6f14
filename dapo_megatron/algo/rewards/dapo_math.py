"""``dapo_math``: the rule-based reward of the DAPO-Math data set.

DAPO's prompts ask for a last line ``Answer: $Answer``. The grader looks for the last
``Answer:`` line in the final characters of the response, normalises both sides (dollar
signs, ``\\boxed{}``, ``\\text{}``, units, spaces, trailing period, thousands separators)
and compares them exactly; the reference answers are integers, so exact comparison is
the right one. Score +1 if equal, -1 otherwise.

Its running time is bounded by construction, whatever the response: only the last
``TAIL_CHARS`` characters are read, and every regular expression below is linear or
works on that bounded window. That is what lets the trainer run it in-process.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

from dapo_megatron.algo.rewards.registry import RewardResult, register_reward

TAIL_CHARS = 300
"""How far from the end the ``Answer:`` line is looked for, as in DAPO's grader."""

_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_UNWRAP = ("text", "textbf", "textrm", "textnormal", "mathrm", "mathbf", "mbox", "operatorname")
_DROP = ("\\displaystyle", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "$", "\\(", "\\)", "\\[", "\\]")
_UNIT_WORDS = (
    "units?",
    "dollars?",
    "cents?",
    "degrees?",
    "points?",
    "feet",
    "foot",
    "ft",
    "inch(?:es)?",
    "in",
    "miles?",
    "mph",
    "meters?",
    "m",
    "cm",
    "mm",
    "km",
    "kg",
    "g",
    "grams?",
    "pounds?",
    "lbs?",
    "hours?",
    "minutes?",
    "seconds?",
    "days?",
    "weeks?",
    "years?",
    "ways",
    "people",
    "students",
    "integers?",
    "numbers?",
    "digits?",
    "sq",
    "square",
    "cubic",
)
# One unit word at the very end ("cm", "cm^2"). Applied a bounded number of times rather
# than as a repeated group: "m" and "mm" overlap, and a repeated alternation of overlapping
# words backtracks exponentially on inputs like "1mmmm...x".
_UNIT_AT_END = re.compile(r"\s*\b(?:" + "|".join(_UNIT_WORDS) + r")(?:\^\{?[23]\}?)?\s*$", re.IGNORECASE)
_ENDS_WITH_NUMBER = re.compile(r"[\d}.]\s*$")
_MAX_UNIT_WORDS = 3
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def _last_braced(text: str, command: str) -> Optional[str]:
    """Content of the last ``\\command{...}`` in ``text``, braces matched; None if absent."""
    start = text.rfind(command + "{")
    if start < 0:
        return None
    depth, begin = 0, start + len(command)
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin + 1 : i]
    return text[begin + 1 :]  # unclosed: take the rest


def _unwrap_commands(text: str) -> str:
    """``\\text{5 cm}`` -> ``5 cm`` for formatting commands, innermost first."""
    pattern = re.compile(r"\\(?:" + "|".join(_UNWRAP) + r")\s*\{([^{}]*)\}")
    for _ in range(8):  # nesting depth bound: the window is small anyway
        text, count = pattern.subn(r"\1", text)
        if not count:
            break
    return text


def _strip_units(text: str) -> str:
    """``12 square feet`` -> ``12``: drop trailing unit words, only when a number precedes them."""
    stripped = text
    for _ in range(_MAX_UNIT_WORDS):
        match = _UNIT_AT_END.search(stripped)
        if match is None:
            break
        stripped = stripped[: match.start()]
    return stripped if stripped != text and _ENDS_WITH_NUMBER.search(stripped) else text


def normalize_answer(answer: str) -> str:
    """Canonical form of an answer string, for exact comparison."""
    s = answer.strip().strip("*").strip()
    boxed = _last_braced(s, "\\boxed")
    if boxed is None:
        boxed = _last_braced(s, "\\fbox")
    if boxed is not None:
        s = boxed
    s = _unwrap_commands(s)
    for token in _DROP:
        s = s.replace(token, " " if token.startswith("\\") and token[1:2].isalpha() else "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = _DEGREES.sub("", s).replace("\\%", "").replace("%", "")
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    s = _strip_units(s)
    s = "".join(s.split()).rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _NUMBER.fullmatch(s):
        try:
            number = Decimal(s)
        except InvalidOperation:
            return s
        if number == number.to_integral_value():
            return str(int(number))
        return format(number.normalize(), "f")
    return s


def extract_answer(response: str) -> Optional[str]:
    """The text after the last ``Answer:`` in the response's tail, up to the line end."""
    tail = response[-TAIL_CHARS:]
    last = None
    for match in _ANSWER.finditer(tail):
        last = match
    if last is None:
        return None
    line = tail[last.end() :].split("\n", 1)[0]
    return line.strip() or None


@register_reward("dapo_math", bounded=True)
def dapo_math_reward(response: str, ground_truth: str) -> RewardResult:
    """+1 when the last ``Answer:`` line equals the ground truth after normalisation, else -1."""
    raw = extract_answer(response)
    if raw is None:
        return RewardResult(score=-1.0, correct=False, prediction=None)
    prediction = normalize_answer(raw)
    correct = prediction != "" and prediction == normalize_answer(str(ground_truth))
    return RewardResult(score=1.0 if correct else -1.0, correct=correct, prediction=prediction)
