"""docs/configuration.md is the config's own field docstrings, current with the code."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_current():
    tool = _tool()
    assert (ROOT / "docs" / "configuration.md").read_text() == tool.render(), (
        "docs/configuration.md is not current: run .venv/bin/python tools/config_reference.py"
    )


def test_every_config_field_has_a_docstring_and_is_in_the_reference():
    """The house rule the reference relies on; a field without one would show an empty cell."""
    from dapo_megatron.config import Config

    tool = _tool()
    text = (ROOT / "docs" / "configuration.md").read_text()
    for section in dataclasses.fields(Config):
        documented = tool._field_docs(section.default_factory)
        names = [name for name, *_ in documented]
        assert names == [f.name for f in dataclasses.fields(section.default_factory)], section.name
        for name, _, _, doc in documented:
            assert doc, f"{section.name}.{name} has no docstring"
            assert f"| `{section.name}.{name}` |" in text
