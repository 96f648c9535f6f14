"""Every command the README and docs/ show runs as written, as far as one process can tell
without training: the ``make`` targets exist; a ``dapo-megatron`` command parses with the
real command line, and the config it names loads and validates with its overrides; a
script's arguments parse with the script's own parser; what ``sbatch`` is given exists.
A renamed script, option, sub-command, config key or make target fails here, naming the
page and the command."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from dapo_megatron.algo.rewards import base as reward_base
from dapo_megatron.cli import build_parser, parse_arguments
from dapo_megatron.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("examples/*/README.md")),
    ROOT / "tools/convert_ckpt/README.md",
]
RUNNERS = ("make", "dapo-megatron", ".venv/bin/dapo-megatron", "python", ".venv/bin/python", "sbatch")
# Shell values a page leaves to the reader, as a command would see them.
SHELL_VALUES = {"$PWD": str(ROOT), "$MODEL_DIR": "/models/m", "$DATA_DIR": "/data", "$OUTPUT_DIR": "/runs/out"}
PLACEHOLDER = re.compile(r"\[|\]\s|<|\.\.\.|\bFILE\b|\bCONFIG\b|\bDIR\b")


def shown_commands() -> list[tuple[str, str]]:
    """``(page, command)`` for every command of a shell block of the pages (continuation
    lines joined, comments dropped), and every ``make`` or ``dapo-megatron`` command in
    the README's table of commands."""
    found = []
    for page in PAGES:
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        for block in re.finditer(r"```(bash|sh|shell|console|)\n(.*?)```", text, re.S):
            for line in block.group(2).replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                for command in re.split(r"\s*(?:&&|;|\|)\s*", line):
                    words = command.split()
                    if words and words[0] in RUNNERS and not (len(words) > 1 and words[1].endswith(":")):
                        found.append((name, command))
        if page.name == "README.md" and page.parent == ROOT:
            for cell in re.findall(r"^\| `((?:make|dapo-megatron) [^`]*)`", text, re.M):
                found.append((name, cell if cell.startswith("make") else f"{cell} [...]"))  # a synopsis
    return found


def _words(command: str) -> list[str]:
    command = re.sub(r"\$\([^)]*\)", "now", command)
    for name, value in SHELL_VALUES.items():
        command = command.replace(name, value)
    return shlex.split(command)


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


class _Parsed(Exception):
    """A script's parser accepted its arguments (raised instead of running the script)."""


def _script_parses(script: Path, args: list[str], monkeypatch) -> None:
    """Run ``script`` as ``__main__`` with ``args`` up to its ``parse_args``: a wrong
    option exits 2 there; accepted ones stop it before it does any work."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        original(self, *a, **k)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    # What a script does at import stays with this test: its sys.path entries, the
    # rewards it registers (a benchmark registers its own).
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(reward_base, "REGISTRY", dict(reward_base.REGISTRY))
    with pytest.raises(_Parsed):
        runpy.run_path(str(script), run_name="__main__")


def check_command(command: str, monkeypatch) -> None:
    words = _words(command)
    runner, rest = words[0], words[1:]
    if runner == "make":
        targets = [t for w in rest if w != "/" for t in w.split("/")]
        assert set(targets) <= _make_targets(), f"no make target {set(targets) - _make_targets()}"
    elif runner.endswith("dapo-megatron"):
        if PLACEHOLDER.search(command):  # a synopsis: its sub-command and options exist
            commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
            assert rest[0] in commands.choices, f"no sub-command {rest[0]}"
            known = {o for a in commands.choices[rest[0]]._actions for o in a.option_strings}
            options = {w.strip("[]").split("=")[0] for w in rest if w.strip("[").startswith("--")}
            assert options <= known, f"{rest[0]} has no option {options - known}"
            return
        args = parse_arguments(build_parser(), rest)
        if hasattr(args, "overrides") and (ROOT / args.file).is_file():
            load_config(ROOT / args.file, args.overrides)
    elif runner.endswith("python"):
        if rest[:2] == ["-m", "pytest"]:
            assert all((ROOT / p).exists() for p in rest[2:] if not p.startswith("-")), rest
            return
        script = ROOT / rest[0]
        assert script.is_file(), f"no script {rest[0]}"
        # A path the reader supplies (``/models/...``) is not here to be read by the parser.
        readers = [w for w in rest if w.startswith("/") and not Path(w).exists()]
        if "..." not in rest and not readers:
            _script_parses(script, rest[1:], monkeypatch)
    elif runner == "sbatch":
        script = ROOT / rest[-1]
        assert script.is_file(), f"no batch script {rest[-1]}"
        for setting in re.findall(r"RECIPE=([^,\s]+)", command):
            assert (ROOT / setting).is_file(), f"no recipe {setting}"


def test_the_pages_show_commands_of_every_kind():
    """The extraction finds what the pages show (a test that checked nothing would pass)."""
    runners = {Path(_words(command)[0]).name for _, command in shown_commands()}
    assert {"make", "dapo-megatron", "python", "sbatch"} <= runners
    assert len(shown_commands()) > 25


@pytest.mark.parametrize(("page", "command"), shown_commands(), ids=lambda value: value[:60])
def test_every_shown_command_runs_as_written(page, command, monkeypatch):
    check_command(command, monkeypatch)


def test_a_renamed_option_or_key_is_caught(monkeypatch):
    """Negative controls: a wrong option, config key, make target and script argument each fail."""
    with pytest.raises(SystemExit):
        check_command("dapo-megatron plan examples/qwen2_5_32b/dapo.yaml --rehearsal", monkeypatch)
    with pytest.raises(Exception, match="parallel.tensor_size"):
        check_command("dapo-megatron plan examples/qwen2_5_32b/dapo.yaml parallel.tensor_size=8", monkeypatch)
    with pytest.raises(AssertionError, match="no make target"):
        check_command("make demo-agents", monkeypatch)
    with pytest.raises(SystemExit):
        check_command(".venv/bin/python benchmarks/bench_packing.py --repetitions 5", monkeypatch)
