"""Exact rational value of a small LaTeX arithmetic expression, or None.

Models often write a correct answer unevaluated: ``\\frac{84}{2}`` for 42,
``\\sqrt{7396}`` for 86, ``2^{10}`` for 1024. DAPO's rule compares values, so these are
right; a string comparison calls them wrong. This module evaluates such expressions
with :class:`fractions.Fraction`, so equality is exact: no floating point, no
rounding, and a square root counts only when it is exactly rational.

It is a recursive-descent parser over a deliberately small grammar (numbers, ``+ - * /``,
``\\cdot``, ``\\times``, ``\\div``, ``\\frac``, ``\\sqrt`` and ``\\sqrt[n]``, powers,
parentheses and braces, implicit multiplication). Anything else returns None, which the
reward treats as "not equal". Its work is bounded whatever the input: the expression
length, the nesting depth, exponents and the size of every intermediate number are all
capped, so it can run in-process on model output (sympy cannot promise that).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Optional

MAX_CHARS = 200
"""Longer expressions are not evaluated (a final answer is short)."""
MAX_DEPTH = 32
"""Nesting depth bound (parentheses, braces, fractions, roots)."""
MAX_BITS = 4096
"""Bound on the size of any intermediate numerator or denominator, in bits."""
MAX_ROOT = 16
"""Largest root index accepted in ``\\sqrt[n]{...}``."""

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\\[A-Za-z]+)|([-+*/^(){}\[\]]))")
_IGNORED = {"\\left", "\\right", "\\displaystyle"}
_TIMES = {"*", "\\cdot", "\\times"}
_DIVIDE = {"/", "\\div"}
_FRACTIONS = {"\\frac", "\\dfrac", "\\tfrac"}
_CLOSING = {"(": ")", "{": "}", "[": "]"}


class _Unsupported(Exception):
    """The expression leaves the grammar or a bound: its value is unknown."""


def exact_value(text: str) -> Optional[Fraction]:
    """The exact value of ``text``, or None when it is not a bounded rational expression."""
    if not text or len(text) > MAX_CHARS:
        return None
    try:
        tokens = _tokenize(text)
        if not tokens:
            return None
        parser = _Parser(tokens)
        value = parser.expression(0)
        if parser.position != len(tokens):
            return None
        return value
    except (_Unsupported, ZeroDivisionError):
        return None


def _tokenize(text: str) -> list[str]:
    tokens, position = [], 0
    while position < len(text):
        if text[position].isspace():
            position += 1
            continue
        match = _TOKEN.match(text, position)
        if match is None:
            raise _Unsupported(text[position])
        token = match.group(1) or match.group(2) or match.group(3)
        if token not in _IGNORED:
            tokens.append(token)
        position = match.end()
    return tokens


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise _Unsupported("number too large")
    return value


def _integer_root(value: int, index: int) -> Optional[int]:
    """The exact ``index``-th root of a non-negative integer, or None if it is not one."""
    if index == 2:
        root = math.isqrt(value)
        return root if root * root == value else None
    low, high = 0, 1 << (value.bit_length() // index + 1)
    while low < high:
        middle = (low + high) // 2
        if middle**index < value:
            low = middle + 1
        else:
            high = middle
    return low if low**index == value else None


def _root(value: Fraction, index: int) -> Fraction:
    if index < 1 or index > MAX_ROOT:
        raise _Unsupported("root index")
    negative = value < 0
    if negative and index % 2 == 0:
        raise _Unsupported("even root of a negative number")
    numerator = _integer_root(abs(value.numerator), index)
    denominator = _integer_root(value.denominator, index)
    if numerator is None or denominator is None:
        raise _Unsupported("irrational root")
    return Fraction(-numerator if negative else numerator, denominator)


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        return _power(_root(base, exponent.denominator), Fraction(exponent.numerator))
    count = exponent.numerator
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    if abs(count) * max(size, 1) > MAX_BITS:
        raise _Unsupported("power too large")
    return _checked(base**count)


class _Parser:
    """expression := term (('+'|'-') term)*; term := unary ((op)? unary)*; unary := sign* power."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.position = 0

    def _peek(self) -> Optional[str]:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise _Unsupported("unexpected end")
        self.position += 1
        return token

    def _expect(self, token: str) -> None:
        if self._take() != token:
            raise _Unsupported(f"expected {token}")

    def expression(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise _Unsupported("too deep")
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            sign = self._take()
            other = self.term(depth)
            value = _checked(value + other if sign == "+" else value - other)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.unary(depth)
        while True:
            token = self._peek()
            if token in _TIMES:
                self._take()
                value = _checked(value * self.unary(depth))
            elif token in _DIVIDE:
                self._take()
                value = _checked(value / self.unary(depth))
            elif token is not None and self._starts_atom(token):
                value = _checked(value * self.unary(depth))  # implicit: 2\sqrt{9}, 3(4)
            else:
                return value

    @staticmethod
    def _starts_atom(token: str) -> bool:
        return token in ("(", "{") or token in _FRACTIONS or token == "\\sqrt" or token[0].isdigit()

    def unary(self, depth: int) -> Fraction:
        token = self._peek()
        if token in ("+", "-"):
            self._take()
            value = self.unary(depth + 1)
            return -value if token == "-" else value
        return self.power(depth)

    def power(self, depth: int) -> Fraction:
        base = self.atom(depth)
        if self._peek() == "^":
            self._take()
            exponent = self.unary(depth + 1) if self._peek() in ("+", "-") else self.power(depth + 1)
            return _power(base, exponent)
        return base

    def _group(self, depth: int) -> Fraction:
        """A braced argument, or one digit as in ``\\frac12``."""
        if self._peek() == "{":
            return self.atom(depth)
        token = self._take()
        if token[0].isdigit():
            # \frac12 means \frac{1}{2}: one digit per argument; give the rest back.
            if len(token) > 1 and "." not in token:
                self.tokens[self.position - 1] = token[1:]
                self.position -= 1
            return Fraction(token[0])
        raise _Unsupported("argument")

    def atom(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise _Unsupported("too deep")
        token = self._take()
        if token[0].isdigit() or token[0] == ".":
            return _checked(Fraction(token))
        if token in _CLOSING:
            value = self.expression(depth + 1)
            self._expect(_CLOSING[token])
            return value
        if token in _FRACTIONS:
            numerator = self._group(depth + 1)
            denominator = self._group(depth + 1)
            return _checked(numerator / denominator)
        if token == "\\sqrt":
            index = Fraction(2)
            if self._peek() == "[":
                self._take()
                index = self.expression(depth + 1)
                self._expect("]")
            if index.denominator != 1:
                raise _Unsupported("root index")
            return _root(self._group(depth + 1), index.numerator)
        raise _Unsupported(token)
