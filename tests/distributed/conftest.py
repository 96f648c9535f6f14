"""What the distributed tests share: one random tiny model as a megatron dist checkpoint
(:func:`tests.distributed.layout_worker.save_initial`, vocabulary 128), written once for
the session and copied into each test's folder (a copy: no test can change another's)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dapo_megatron.runtime.launch import launch_local
from tests.distributed import layout_worker


@pytest.fixture(scope="session")
def initial_checkpoint(tmp_path_factory) -> Path:
    """The folder whose ``init`` holds the shared initial checkpoint."""
    workdir = tmp_path_factory.mktemp("initial")
    launch_local(layout_worker.save_initial, 1, (str(workdir),))
    return workdir


def copy_initial(initial: Path, folder: Path) -> Path:
    """A copy of the checkpoint ``initial / "init"`` in ``folder / "init"`` (what
    ``save_initial(folder)`` would have written there); returns ``folder``."""
    shutil.copytree(Path(initial) / "init", Path(folder) / "init")
    return Path(folder)


@pytest.fixture
def with_initial(initial_checkpoint):
    """``with_initial(folder)``: :func:`copy_initial` of the session's initial checkpoint."""
    return lambda folder: copy_initial(initial_checkpoint, folder)
