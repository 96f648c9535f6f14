"""Writes docs/configuration.md, the configuration reference, from the config's own code.

Every field of every config section carries a docstring (the string right after it, the
house rule); this reads them from the source with ``ast`` (Python keeps no field
docstrings at run time), with each field's type and default as written there, in the
order of the sections of ``Config`` and of their fields. The reference is then never
out of step with the code: ``tests/unit/test_config_reference.py`` fails when the file
differs from what this writes.

Run: ``.venv/bin/python tools/config_reference.py`` (writes the file) or ``--check``
(exit 1 when it is not current).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUTPUT = ROOT / "docs" / "configuration.md"

HEADER = """# Configuration reference

A run's config is one YAML file with the sections below (`dapo-megatron train CONFIG
[section.key=value ...]`: each override's value is read as YAML, so lists are `[a,b]`).
`dapo-megatron config CONFIG` checks a config and prints it fully resolved. This page is
generated from the field docstrings of `dapo_megatron/config/sections.py` and
`dapo_megatron/config/model.py` by `tools/config_reference.py`; a test fails when it is
not current.
"""


def _field_docs(cls) -> list[tuple[str, str, str, str]]:
    """``(name, type, default, docstring)`` of each field of dataclass ``cls``, as written
    in its source."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    out = []
    for node, after in zip(body, body[1:] + [None]):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        doc = ""
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            doc = inspect.cleandoc(after.value.value)
        default = ast.get_source_segment(source, node.value) if node.value is not None else ""
        out.append((node.target.id, ast.get_source_segment(source, node.annotation), default, doc))
    return out


def _default_text(default: str) -> str:
    """A default as the YAML reader writes it (``field(default_factory=list)``: ``[]``)."""
    if default.startswith("field(") and "default_factory=" in default:
        factory = default.split("default_factory=", 1)[1].rstrip(")").strip()
        return {"list": "[]", "dict": "{}"}.get(factory, f"{factory}()")
    return default


def _cell(text: str) -> str:
    """``text`` for one markdown table cell (one line, ``|`` escaped)."""
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The reference's markdown."""
    from dapo_megatron.config import Config

    parts = [HEADER.rstrip()]
    sections = _field_docs(Config)
    types = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    index = ["| section | what |", "| --- | --- |"]
    index.extend(f"| [`{name}`](#{name}) | {_cell(doc)} |" for name, _, _, doc in sections)
    parts.append("\n".join(index))
    for name, _, _, doc in sections:
        cls = types[name]
        parts.append(f"## {name}\n\n{_cell(inspect.cleandoc(cls.__doc__ or '') or doc)}")
        rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for key, annotation, default, text in _field_docs(cls):
            rows.append(
                f"| `{name}.{key}` | `{_cell(annotation)}` | `{_cell(_default_text(default))}` | {_cell(text)} |"
            )
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(ROOT)} is not current: run .venv/bin/python tools/config_reference.py")
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
