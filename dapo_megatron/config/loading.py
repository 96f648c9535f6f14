"""Loading a config: read the YAML file (a mapping of sections), resolve its relative
paths against the file's folder, apply dotted ``key=value`` overrides (their paths against
the current directory), check every key and type against the sections (unknown key,
wrong type: refused), fill the model shape from the HF ``config.json`` when one is named,
then check the rules that span keys (:mod:`dapo_megatron.config.validate`).

Errors are :class:`ConfigError` and name where the value came from, the key, the value
and the rule, e.g. ``run.yaml: parallel.tp_size=3 must divide model.num_attention_heads=40``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

import yaml

from dapo_megatron.config.io import COMMAND_LINE, ConfigError, ValueSources, apply_override, build_dataclass
from dapo_megatron.config.model import resolve_model_shape
from dapo_megatron.config.sections import Config
from dapo_megatron.config.validate import validate

PATH_KEYS = (
    "model.hf_config",
    "model.hf_weights",
    "data.train_files",
    "data.val_files",
    "data.tokenizer",
    "trainer.output_dir",
    "checkpoint.save_dir",
    "checkpoint.load_dir",
)
"""Keys that hold file or folder paths. A relative path written in a YAML file means a
path next to that file, wherever the command runs (a config and its data can be moved
together); one given on the command line means one in the current directory. Both are
stored absolute, so the resolved config written into the run folder loads anywhere, and
errors show the path that was actually looked at. Paths left at their defaults (and
those of a config built from a dict) are relative to the current directory."""


def _absolute(value: Any, base: Path) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [_absolute(item, base) for item in value]
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else (base / path).resolve())


def _resolve_paths(config: Config, sources: dict[str, str], file_source: str, file_dir: Optional[Path]) -> None:
    """Make every path absolute: set in the file against ``file_dir``, else against the cwd."""
    for dotted in PATH_KEYS:
        from_file = sources.get(dotted) == file_source and file_dir is not None
        base = file_dir if from_file else Path.cwd()
        section, key = dotted.split(".")
        holder = getattr(config, section)
        setattr(holder, key, _absolute(getattr(holder, key), base))


def load_config(path: Optional[str | os.PathLike], overrides: Optional[list[str]] = None) -> Config:
    """Load, override, resolve and validate a config.

    Args:
        path: a YAML file; ``None`` starts from the defaults.
        overrides: ``section.key=value`` strings applied on top of the file.

    Raises:
        ConfigError: anything wrong, with source, key, value and rule in the message.
    """
    source = str(path) if path is not None else "defaults"
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read config file: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping of sections "
                f"({', '.join(f.name for f in dataclasses.fields(Config))}), "
                f"found {type(loaded).__name__}"
            )
        raw = loaded
    folder = Path(path).resolve().parent if path is not None else None
    return config_from_dict(raw, source, overrides, base_dir=folder)


def config_from_dict(
    raw: dict[str, Any],
    source: str = "<dict>",
    overrides: Optional[list[str]] = None,
    *,
    base_dir: Optional[Path] = None,
) -> Config:
    """Build, override, resolve and validate a config from a nested dict (as parsed from YAML).

    ``base_dir``: the folder relative paths in ``raw`` are relative to (the YAML file's);
    without it they stay as written. Paths in ``overrides`` are resolved against the
    current directory (see :data:`PATH_KEYS`).
    """
    sources: dict[str, str] = {}
    config = build_dataclass(Config, raw, "", source, sources)
    for override in overrides or []:
        apply_override(config, override)
        sources[override.split("=", 1)[0].strip()] = COMMAND_LINE
    _resolve_paths(config, sources, source, base_dir)
    resolve_model_shape(config.model, ValueSources(sources, source))
    validate(config, sources=sources, default_source=source)
    config._where = ValueSources(sources, source)  # not a field: never written to YAML
    return config


def source_of(config: Config, *keys: str) -> str:
    """Where the values of ``keys`` came from (the file, the command line, or both), for
    messages about a loaded config; ``"config"`` for one not built by :func:`load_config`."""
    where = getattr(config, "_where", None)
    return where(*keys) if where is not None else "config"
