"""``calculator``: arithmetic as a tool, for the demo's task that a tiny model cannot do in
its head (three-digit multiplication) but can with a calculator.

The model writes ``<calc>EXPRESSION</calc>`` (the turn ends at ``</calc>``); the episode
answers ``<result>VALUE</result>``, and the model goes on. A turn without a call ends the
episode (its text holds the answer the reward reads). The expression is read with
``ast`` and only integer arithmetic is evaluated (``+ - * // %`` and parentheses, numbers
of at most :data:`MAX_DIGITS` digits, no powers): nothing the model writes runs as code,
and no expression can take long or grow large. A bad expression is answered
``<result>error: ...</result>`` and counted as a tool error.
"""

from __future__ import annotations

import ast
import operator
from typing import Optional

from dapo_megatron.data import Prompt
from dapo_megatron.sampling.environments.base import Environment, Episode, Observation, tagged_call

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 30
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate, and why."""


def evaluate(expression: str) -> int:
    """The value of an integer expression (see the module docstring); CalculatorError
    naming what is refused."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(_OPERATORS[type(node.op)](left, right))
    what = node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node
    raise CalculatorError(f"{type(what).__name__} is not integer arithmetic")


def _bounded(value: int) -> int:
    if abs(value) >= 10**MAX_DIGITS:
        raise CalculatorError(f"a number of more than {MAX_DIGITS} digits")
    return value


def called_expression(turn_text: str) -> Optional[str]:
    """The expression of the turn's call, or None without one (see :func:`tagged_call`)."""
    return tagged_call(turn_text, "<calc>", "</calc>")


class CalculatorEpisode(Episode):
    """One prompt's episode: answers each call, ends at a turn without one."""

    def step(self, turn_ids: list[int], turn_text: str) -> Observation:
        expression = called_expression(turn_text)
        if expression is None:
            return Observation(done=True)
        try:
            return Observation(text=f"<result>{evaluate(expression)}</result>", tool_calls=1)
        except CalculatorError as exc:
            return Observation(text=f"<result>error: {exc}</result>", tool_calls=1, tool_errors=1)


class CalculatorEnvironment(Environment):
    """Integer arithmetic as a tool (see the module docstring)."""

    stop_strings = ("</calc>",)

    def start(self, prompt: Prompt) -> Episode:
        return CalculatorEpisode()
