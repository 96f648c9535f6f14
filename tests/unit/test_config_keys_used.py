"""No setting is accepted and ignored: every field of the config is read somewhere in the
package outside the config modules (a key that only validation looks at does nothing).
Keys retired for that reason are refused with the reason."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dapo_megatron.config import Config, ConfigError, config_from_dict

PACKAGE = Path(__file__).resolve().parents[2] / "dapo_megatron"
CONFIG_MODULES = {
    PACKAGE / "config" / name for name in ("__init__.py", "sections.py", "loading.py", "validate.py", "io.py")
}
"""The modules that define, load and validate the settings (reading a key there does not use it)."""


def _leaf_fields():
    config = Config()
    leaves = []

    def walk(obj, prefix):
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{field.name}.")
            else:
                leaves.append(f"{prefix}{field.name}")

    walk(config, "")
    return leaves


READ_THROUGH_HELPERS = {"checkpoint.save_dir": "checkpoint_save_dir"}
"""Keys read through a derived fact of the config (a property, which must itself be read
outside the config modules)."""


def _is_read(dotted: str, code: str, shared_names: set[str]) -> bool:
    section, name = dotted.rsplit(".", 1)
    if dotted in READ_THROUGH_HELPERS:
        return re.search(rf"\.{READ_THROUGH_HELPERS[dotted]}\b", code) is not None
    if name in shared_names:  # e.g. seed, in three sections: the section (or its initial) must read it
        last = section.rsplit(".", 1)[-1]
        return re.search(rf"\b({last}|{last[0]})\.{name}\b", code) is not None
    return re.search(rf"\.{name}\b", code) is not None


def test_every_config_key_is_read_outside_the_config_modules():
    code = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p not in CONFIG_MODULES)
    leaves = _leaf_fields()
    names = [dotted.rsplit(".", 1)[-1] for dotted in leaves]
    shared = {name for name in names if names.count(name) > 1}
    assert len(leaves) > 80 and "seed" in shared
    unread = [dotted for dotted in leaves if not _is_read(dotted, code, shared)]
    assert unread == [], f"accepted but never read outside the config modules: {unread}"
    # Negative control: a key nobody reads is found.
    assert not _is_read("checkpoint.async_save", code, shared)


@pytest.mark.parametrize("key", ["checkpoint.async_save"])
def test_retired_keys_are_refused_with_the_reason(key):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=rf"{key} is not a setting: .*remove the key"):
        config_from_dict({section: {name: True}}, "run.yaml")
