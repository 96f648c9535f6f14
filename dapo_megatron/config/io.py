"""Typed YAML for dataclasses: strict building, dotted overrides, and their errors.

The machinery under :mod:`dapo_megatron.config`, kept apart from the sections it builds:
a mapping becomes a dataclass only if every key is a field and every value has the
field's type (the only conversions are int -> float, numeric text -> float, and, for
command-line text, text -> str), and ``section.key=value`` overrides are parsed the same
way. Errors name the source, the key, the value and the expected type.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union

import yaml

COMMAND_LINE = "command line"


class ConfigError(ValueError):
    """A config that cannot be run. The message names source, key, value and rule."""


def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"list of {_type_name(item)}"
    if origin is dict:
        key, item = typing.get_args(tp)
        return f"mapping of {_type_name(key)} to {_type_name(item)}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    pass


def _coerce(value: Any, tp: Any, *, from_text: bool) -> Any:
    """Return ``value`` as type ``tp`` or raise _Mismatch.

    Strict: the only conversions are int -> float, a numeric string -> float (PyYAML
    reads ``1e-6`` as a string) and, for command-line text, the raw text -> str. A
    mapping's keys and values are checked one by one (a union tries its types in order).
    """
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, from_text=from_text)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise _Mismatch
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str) and from_text:
            value = [value]
        if not isinstance(value, list):
            raise _Mismatch
        return [_coerce(v, item, from_text=from_text) for v in value]
    if origin is dict:
        key_type, item = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _Mismatch
        return {_coerce(k, key_type, from_text=False): _coerce(v, item, from_text=False) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise _Mismatch from None
            if not math.isfinite(number):
                raise _Mismatch
            return number
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    raise TypeError(f"unsupported config type {tp!r}")


RETIRED_KEYS = {
    "checkpoint.async_save": "checkpoints are written synchronously; remove the key (earlier versions accepted it and "
    "ignored it)",
}
"""Keys that earlier versions accepted without acting on them: refused with the reason."""


def _refuse_retired(source: str, dotted: str) -> None:
    if dotted in RETIRED_KEYS:
        raise ConfigError(f"{source}: {dotted} is not a setting: {RETIRED_KEYS[dotted]}")


def build_dataclass(cls: type, raw: Any, prefix: str, source: str, sources: dict[str, str]) -> Any:
    """Build dataclass ``cls`` from ``raw``, refusing unknown keys and wrong types."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping of keys, found {type(raw).__name__} {raw!r}")
    hints = _type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            _refuse_retired(source, dotted)
            raise ConfigError(f"{source}: unknown key {dotted!r}; known keys of {where}: {', '.join(known)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_dataclass(tp, value if value is not None else {}, f"{dotted}.", source, sources)
            continue
        try:
            kwargs[key] = _coerce(value, tp, from_text=False)
        except _Mismatch:
            raise ConfigError(
                f"{source}: {dotted}={value!r} has the wrong type: expected {_type_name(tp)}, "
                f"found {type(value).__name__}"
            ) from None
        sources[dotted] = source
    return cls(**kwargs)


def apply_override(config: Any, override: str) -> None:
    """Apply one ``section.key=value`` override to a dataclass tree in place, with type coercion."""
    if "=" not in override:
        raise ConfigError(f"{COMMAND_LINE}: override {override!r} must look like section.key=value")
    dotted, text = (part.strip() for part in override.split("=", 1))
    parts = dotted.split(".")
    target: Any = config
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(target):
            raise ConfigError(f"{COMMAND_LINE}: {dotted!r} is not a config key")
        names = [f.name for f in dataclasses.fields(target)]
        if part not in names:
            _refuse_retired(COMMAND_LINE, dotted)
            where = ".".join(parts[:depth]) or "the top level"
            raise ConfigError(f"{COMMAND_LINE}: unknown key {dotted!r}; known keys of {where}: {', '.join(names)}")
        if depth < len(parts) - 1:
            target = getattr(target, part)
    name = parts[-1]
    tp = _type_hints(type(target))[name]
    if dataclasses.is_dataclass(tp):
        raise ConfigError(
            f"{COMMAND_LINE}: {dotted!r} is a section; override one of its keys, "
            f"e.g. {dotted}.{dataclasses.fields(tp)[0].name}=..."
        )
    try:
        parsed = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        parsed = text
    try:
        value = _coerce(parsed, tp, from_text=True)
    except _Mismatch:
        # A str field given text that YAML read as a number or bool keeps the text.
        try:
            value = _coerce(text, tp, from_text=True)
        except _Mismatch:
            raise ConfigError(
                f"{COMMAND_LINE}: {dotted}={text} has the wrong type: expected {_type_name(tp)}"
            ) from None
    setattr(target, name, value)


class ValueSources:
    """Tells where the values of some dotted keys came from: the file, the command line, or
    both. Keys left at their defaults or read from the model's ``config.json`` (which the
    user does not edit) count as the default source, the config file."""

    def __init__(self, sources: dict[str, str], default: str) -> None:
        self.sources = sources
        self.default = default

    def __call__(self, *keys: str) -> str:
        """One source by name; several, each with its keys: ``command line (a.b) and run.yaml (c.d)``."""
        by_source: dict[str, list[str]] = {}
        for key in keys:
            if key in self.sources:
                by_source.setdefault(self.sources[key], []).append(key)
        if len(by_source) <= 1:
            return next(iter(by_source), self.default)
        return " and ".join(f"{source} ({', '.join(names)})" for source, names in by_source.items())
