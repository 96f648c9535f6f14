"""Faults end a run with a clear error within a bounded time, and ``--resume`` goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from dapo_megatron.ckpt.dcp_io import latest_checkpoint
from dapo_megatron.trainer import TRAINER_STATE
from tests.e2e.conftest import REPO, run_config

SIX_STEPS = {
    "trainer.num_steps": 6,
    "checkpoint.save_every": 1,
    "trainer.val_before_train": False,
    "trainer.val_every": 0,
}


def _logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _ray_workers(root: int, title: str) -> list[psutil.Process]:
    """Descendants of ``root`` whose process title starts with ``title`` (Ray names its
    workers ``ray::ClassName[.method]``)."""
    found = []
    for child in psutil.Process(root).children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith(title):
                found.append(child)
        except psutil.Error:
            continue
    return found


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("title", "named"), [("ray::EngineWorker", "rollout engine 0"), ("ray::ActorRank", "actor rank")]
)
def test_a_killed_worker_ends_the_run_clearly_and_resume_continues(tiny_model, tmp_path, title, named):
    run = tmp_path / "run"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config(tiny_model, run, **SIX_STEPS)))
    command = [sys.executable, "-m", "dapo_megatron", "train", str(path)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while len(_logged_steps(run)) < 2:
        assert process.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.2)
    victims = _ray_workers(process.pid, title)
    if title == "ray::ActorRank":
        victims = victims[1:]  # rank 1 of the two (placement order)
    assert victims, f"no {title} process under the trainer"
    victims[0].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    output, _ = process.communicate(timeout=300)
    seconds = time.monotonic() - killed
    assert process.returncode == 1, output
    assert f"dapo-megatron train: error: {named}" in output, output[-3000:]
    assert " died: " in output and "add --resume to continue from it" in output
    assert seconds < 120, f"took {seconds:.0f} s to end"
    checkpoint = latest_checkpoint(run / "checkpoints")
    saved = json.loads((checkpoint / TRAINER_STATE).read_text())["step"]
    assert saved >= 1
    print(f"{title} killed: the run ended {seconds:.1f} s later; last checkpoint step {saved}")

    resumed = subprocess.run([*command, "--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert sorted(set(_logged_steps(run))) == [1, 2, 3, 4, 5, 6] and len(_logged_steps(run)) == 6
