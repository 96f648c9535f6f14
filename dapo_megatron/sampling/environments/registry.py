"""``rollout.env``'s names: the built-in environments, or ``module:Class`` for a user's
own (a subclass of :class:`~dapo_megatron.sampling.environments.base.Environment` whose
keyword arguments, if any, come from ``rollout.env_options``), resolved and built before
anything starts, as ``reward_fn`` is."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from dapo_megatron.sampling.environments.base import Environment

BUILT_IN = {
    "calculator": "dapo_megatron.sampling.environments.calculator:CalculatorEnvironment",
    "python": "dapo_megatron.sampling.environments.python_tool:PythonEnvironment",
}


def available_environments() -> list[str]:
    """The registered names."""
    return sorted(BUILT_IN)


def resolve_environment(name: str) -> type[Environment]:
    """The environment class of a registered name or a ``module:Class`` path; ValueError
    naming what is wrong and what is available."""
    path = BUILT_IN.get(name, name)
    module_name, _, attribute = path.partition(":")
    if not attribute:
        raise ValueError(
            f"unknown environment {name!r}; registered: {', '.join(available_environments())}, "
            "or name your own as module:Class"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"environment {name!r}: cannot import {module_name!r} ({exc})") from exc
    found = getattr(module, attribute, None)
    if not (isinstance(found, type) and issubclass(found, Environment)):
        raise ValueError(
            f"environment {name!r}: {module_name}.{attribute} is "
            f"{'missing' if found is None else type(found).__name__}, not a subclass of "
            "dapo_megatron.sampling.environments.Environment"
        )
    stops = found.stop_strings
    if not isinstance(stops, tuple) or not all(isinstance(stop, str) and stop for stop in stops):
        raise ValueError(
            f"environment {name!r}: stop_strings must be a tuple of non-empty strings (got {stops!r}); an empty "
            "one would end every turn after one token"
        )
    return found


def make_environment(name: str, options: Mapping[str, Any]) -> Environment:
    """The environment ``name`` built with ``options`` as keyword arguments; ValueError
    naming an option it does not take (and those it does) or a value it refuses."""
    cls = resolve_environment(name)
    parameters = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    known = [n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(known))
    if unknown and not takes_any:
        raise ValueError(
            f"environment {name!r} takes no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(known) or 'none'}"
        )
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"environment {name!r} with options {dict(options)}: {exc}") from None
