"""``dapo_math``: the rule-based reward of the DAPO-Math data set.

DAPO's prompts ask for a last line ``Answer: $Answer``. The grader looks for the last
``Answer:`` in the final characters of the response, takes the value written after it,
normalises both sides and compares them exactly. Score +1 if equal, -1 otherwise.

What the rule means to accept, and this grader accepts, is the *value* the model
wrote, however it dressed it: on the next line after ``Answer:``, in dollars (escaped
or not), boxed, bold, in backticks, with units glued on or spaced with TeX spacing, with
prose around it (``The value is $235$.``, ``42 because ...``), followed by an
end-of-sequence token or invisible characters, or unevaluated (``\\frac{84}{2}`` for 42,
compared exactly as rationals by :mod:`exact_value`). What it refuses is hedging: two
different boxed values, or two values joined by prose (``42 or 43``), score wrong.
Numbers are compared digit by digit, never rounded.

Its running time is bounded by construction, whatever the response: only the last
``TAIL_CHARS`` characters (after end-of-sequence tokens are dropped) are read, every
regular expression below is linear or works on that bounded window, and the exact
evaluator has its own size bounds. That is what lets the trainer run it in-process.
"""

from __future__ import annotations

import re
from typing import Optional

from dapo_megatron.algo.rewards.base import RewardResult, register_reward
from dapo_megatron.algo.rewards.exact_value import exact_value

TAIL_CHARS = 300
"""How far from the end the ``Answer:`` line is looked for, as in DAPO's grader."""
_TAIL_MARGIN = 200
"""Extra characters read before cleaning, so removed end tokens do not shrink the window."""

_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
# End-of-sequence and other special tokens a decoder may leave in the text, and
# characters that print as nothing.
_SPECIAL_TOKENS = re.compile(r"<\|[A-Za-z0-9_]{1,32}\|>|</?s>|<(?:eos|pad|bos)>")
_INVISIBLE = re.compile("[\u00ad\u200b-\u200f\u2060-\u2064\ufeff]")
_UNWRAP = ("text", "textbf", "textrm", "textnormal", "textit", "mathrm", "mathbf", "mbox", "operatorname", "bm")
_UNWRAP_PATTERN = re.compile(r"\\(?:" + "|".join(_UNWRAP) + r")\s*\{([^{}]*)\}")
# TeX spacing becomes a space (it separates a number from its unit); \! removes space.
_SPACING = re.compile(r"\\(?:qquad|quad|[,;: ])|~")
_MARKUP = re.compile(r"\\(?:displaystyle|left|right|!)|[`*]|\\\\\s*$")
_MATH_DELIMITERS = re.compile(r"\\[()\[\]]")
_MATH_SPAN = re.compile(r"\$+([^$]*)\$+")
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
_UNIT = re.compile(r"(?:" + "|".join(_UNIT_WORDS) + r")(?:\^\{?[23]\}?)?", re.IGNORECASE)
# One unit word at the very end ("cm", "cm^2"), after a word boundary or glued to a
# digit ("922cm"). Applied a bounded number of times rather than as a repeated group:
# "m" and "mm" overlap, and a repeated alternation of overlapping words backtracks
# exponentially on inputs like "1mmmm...x".
_UNIT_AT_END = re.compile(r"\s*(?:\b|(?<=\d))" + _UNIT.pattern + r"\s*$", re.IGNORECASE)
_ENDS_WITH_NUMBER = re.compile(r"[\d}.]\s*$")
_MAX_UNIT_WORDS = 3
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_PERCENT = re.compile(r"\\?%")
# Where an explanation starts after a value: "42 because ...", "42 (as computed above)".
_EXPLANATION = re.compile(
    r"(?<=[\d}$])\s*(?:\((?=[^()]*[A-Za-z]{2})|[;—]|\b(?:because|since|as|which|where|from|by|using|given|"
    r"so|thus|hence|for|when|after|with|via)\b)",
    re.IGNORECASE,
)
# A prose word: letters not part of a TeX command, not a unit; "a"/"an" before a word.
_WORD = re.compile(r"(?<![\\A-Za-z])(?:[A-Za-z]{2,}|an?(?=\s+[A-Za-z]{2}))(?![A-Za-z])")
_PROSE_GAP = "\x00"
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"([+-]?)(\d*)(?:\.(\d*))?")


def _all_braced(text: str, command: str) -> list[str]:
    """Contents of every ``\\command{...}`` in ``text``, braces matched, in order."""
    contents, start = [], text.find(command + "{")
    while start >= 0:
        depth, begin = 0, start + len(command)
        end = len(text)
        for i in range(begin, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    end = i
                    break
        contents.append(text[begin + 1 : end])  # unclosed: the rest
        start = text.find(command + "{", end)
    return contents


def _unwrap_commands(text: str) -> str:
    """``\\text{5 cm}`` -> ``5 cm`` for formatting commands, innermost first."""
    for _ in range(8):  # nesting depth bound: the window is small anyway
        text, count = _UNWRAP_PATTERN.subn(r"\1", text)
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


def _canonical_number(text: str) -> Optional[str]:
    """``007`` -> ``7``, ``2.50`` -> ``2.5``, ``-0.0`` -> ``0``: exact, digit by digit."""
    match = _NUMBER.fullmatch(text)
    if match is None or not (match.group(2) or match.group(3)):
        return None
    whole = match.group(2).lstrip("0") or "0"
    fraction = (match.group(3) or "").rstrip("0")
    sign = "-" if match.group(1) == "-" and (whole != "0" or fraction) else ""
    return sign + whole + ("." + fraction if fraction else "")


def _remove_prose(text: str) -> str:
    """``The value is 235`` -> ``235``; ``42 or 43`` keeps a gap that makes it ambiguous."""
    if _WORD.search(text) is None:
        return text
    pieces = []
    position = 0
    for match in _WORD.finditer(text):
        if _UNIT.fullmatch(match.group(0)):
            continue
        pieces.append(text[position : match.start()])
        pieces.append(_PROSE_GAP)
        position = match.end()
    pieces.append(text[position:])
    kept = "".join(pieces)
    # Gaps at either end are prose around the value; a gap between values is not.
    parts = [part for part in kept.split(_PROSE_GAP) if part.strip(" \t,.:;!?")]
    return parts[0] if len(parts) == 1 else kept


def _clean(answer: str) -> str:
    """Drop what is never part of a value: markup, special tokens, TeX spacing."""
    s = _INVISIBLE.sub("", _SPECIAL_TOKENS.sub(" ", answer))
    s = s.replace("\u2212", "-").replace("\\$", " ")
    s = _MARKUP.sub("", _SPACING.sub(" ", s))
    return _MATH_DELIMITERS.sub("$", s)


def _value(text: str) -> str:
    """Canonical form of one written value (no boxes left), for exact comparison."""
    s = _unwrap_commands(text)
    if "$" in s:
        spans = _MATH_SPAN.findall(s)
        outside = _MATH_SPAN.sub(" ", s)
        if spans and _WORD.search(outside):  # prose around math: the math is the value
            values = {_value(span) for span in spans if span.strip()}
            if len(values) == 1:
                return values.pop()
            return " | ".join(sorted(values))  # several values: cannot equal a truth
        s = s.replace("$", " ")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = _PERCENT.sub("", _DEGREES.sub("", s))
    explanation = _EXPLANATION.search(s)
    if explanation is not None:
        s = s[: explanation.start()]
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = _remove_prose(s)
    if _PROSE_GAP in s:  # values joined by prose ("42 or 43"): cannot equal a truth
        return " | ".join(part.strip(" ,.;:") for part in s.split(_PROSE_GAP) if part.strip(" ,.;:"))
    s = s.strip().rstrip(".").strip()
    s = _strip_units(s)
    s = "".join(s.split()).rstrip(".,:;!?")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    number = _canonical_number(s)
    return s if number is None else number


def normalize_answer(answer: str) -> str:
    """Canonical form of an answer string, for exact comparison.

    Several different boxed values give a form with ``" | "`` between them, which no
    single value normalises to: a hedged answer never matches.
    """
    s = _clean(answer).strip()
    boxed = _all_braced(s, "\\boxed") or _all_braced(s, "\\fbox")
    if boxed:
        values = list(dict.fromkeys(_value(content) for content in boxed))
        return values[0] if len(values) == 1 else " | ".join(values)
    return _value(s)


def extract_answer(response: str) -> Optional[str]:
    """The text after the last ``Answer:`` in the response's tail.

    That is the rest of its line or, when the line is empty, the next non-empty line
    (``Answer:\\n\\n$855$``). An ``Answer:`` with nothing after it at all (a trailing
    empty one after a complete answer) is skipped for the one before it.
    """
    window = response[-(TAIL_CHARS + _TAIL_MARGIN) :]
    tail = _INVISIBLE.sub("", _SPECIAL_TOKENS.sub("", window))[-TAIL_CHARS:]
    matches = list(_ANSWER.finditer(tail))
    for match in reversed(matches):
        for line in tail[match.end() :].split("\n"):
            if _ANSWER.search(line):
                break
            if line.strip():
                return line.strip()
    return None


def answers_equal(prediction: str, truth: str) -> bool:
    """Equal canonical forms, or both exact rationals with the same value."""
    if not prediction or " | " in prediction:
        return False
    if prediction == truth:
        return True
    value = exact_value(prediction)
    return value is not None and value == exact_value(truth)


@register_reward("dapo_math", bounded=True)
def dapo_math_reward(response: str, ground_truth: str) -> RewardResult:
    """+1 when the last ``Answer:`` value equals the ground truth after normalisation, else -1."""
    raw = extract_answer(response)
    if raw is None:
        return RewardResult(score=-1.0, correct=False, prediction=None)
    prediction = normalize_answer(raw)
    correct = answers_equal(prediction, normalize_answer(str(ground_truth)))
    return RewardResult(score=1.0 if correct else -1.0, correct=correct, prediction=prediction)
