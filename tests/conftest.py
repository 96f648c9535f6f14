"""Test-wide settings: tests marked ``gpu`` are skipped on machines without CUDA; the
demo's base-model preparation, which ``tests/unit/test_demo_base.py`` checks, starts at
the beginning of the session in the background at the lowest CPU priority (``nice
19``), so that its half-minute of training fills the time other tests leave the CPUs
idle (waiting on SLURM, Ray, sleeps) instead of adding to the suite's."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

DEMO_BASE_TEST = "test_the_base_model_follows_its_rule_and_sometimes_writes_the_carry"
DEMO_BASE = pytest.StashKey[tuple]()


def pytest_collection_modifyitems(config, items):
    if any(item.name == DEMO_BASE_TEST for item in items) and len(items) > 1:
        _start_demo_base(config)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _start_demo_base(config) -> None:
    """``examples/demo/prepare.py`` into a folder of the session, niced, its output in a
    file; the test waits for it (``demo_base_in_background``)."""
    folder = Path(tempfile.mkdtemp(prefix="dapo-demo-base-"))
    log = (folder / "prepare.out").open("w")
    script = Path(__file__).resolve().parents[1] / "examples" / "demo" / "prepare.py"
    process = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, str(script), str(folder / "demo")], stdout=log, stderr=subprocess.STDOUT
    )
    config.stash[DEMO_BASE] = (process, folder)


def pytest_sessionfinish(session, exitstatus):
    job = session.config.stash.get(DEMO_BASE, None)
    if job is not None and job[0].poll() is None:
        job[0].kill()
        job[0].wait()


def demo_base_in_background(config):
    """The background preparation's ``(process, folder)``, or None (the test alone was
    asked for: it prepares in its own process)."""
    return config.stash.get(DEMO_BASE, None)
