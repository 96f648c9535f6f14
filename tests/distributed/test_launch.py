"""The local launcher: ranks forked from a preloaded forkserver still see the caller's
environment as it is at each launch, not as it was when the forkserver started."""

from __future__ import annotations

import json
import os

from dapo_megatron.runtime.launch import launch_local
from tests.distributed import launch_worker


def _records(path, nprocs: int) -> list[dict]:
    return [json.loads((path.parent / f"{path.name}.{rank}").read_text()) for rank in range(nprocs)]


def test_ranks_see_the_callers_environment_of_each_launch(tmp_path, monkeypatch):
    first = tmp_path / "first"
    monkeypatch.setenv("DAPO_TEST_MARKER", "before")
    launch_local(launch_worker.report_environment, 2, (str(first),))
    monkeypatch.setenv("DAPO_TEST_MARKER", "after")
    second = tmp_path / "second"
    launch_local(launch_worker.report_environment, 3, (str(second),), env={"OMP_NUM_THREADS": "2"})
    monkeypatch.delenv("DAPO_TEST_MARKER")
    third = tmp_path / "third"
    launch_local(launch_worker.report_environment, 1, (str(third),))

    before, after, unset = _records(first, 2), _records(second, 3), _records(third, 1)
    assert [(r["rank"], r["world_size"], r["marker"], r["threads"]) for r in before] == [
        ("0", "2", "before", 1),
        ("1", "2", "before", 1),
    ]
    assert [(r["marker"], r["threads"]) for r in after] == [("after", 2)] * 3
    assert unset[0]["marker"] is None
    # Forked from one server that imported megatron-core once, not from this process.
    records = before + after + unset
    assert all(r["megatron_preloaded"] for r in records)
    assert len({r["ppid"] for r in records}) == 1 and records[0]["ppid"] != os.getpid()
