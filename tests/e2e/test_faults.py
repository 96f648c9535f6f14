"""Faults end a run with a clear error within a bounded time, and ``--resume`` goes on."""

from __future__ import annotations

import dataclasses
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
from dapo_megatron.cli import main
from dapo_megatron.config import config_from_dict
from dapo_megatron.run.resume import TRAINER_STATE
from dapo_megatron.run.trainer import TrainingDiverged, train
from tests.e2e.conftest import ONE_RANK, REPO, joined, run_config

FOUR_STEPS = {
    "trainer.num_steps": 4,
    "checkpoint.save_every": 1,
    "trainer.val_before_train": False,
    "trainer.val_every": 0,
}


def _logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _ray_workers(title: str) -> list[psutil.Process]:
    """This machine's processes whose title starts with ``title`` (Ray names its workers
    ``ray::ClassName[.method]``), oldest first: on the package's Ray head, only the run
    under test has ranks and engines."""
    found = []
    for process in psutil.process_iter():
        try:
            if " ".join(process.cmdline()).startswith(title):
                found.append(process)
        except psutil.Error:
            continue
    return sorted(found, key=lambda process: process.create_time())


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("title", "named"), [("ray::EngineWorker", "rollout engine 0"), ("ray::ActorRank", "actor rank")]
)
def test_a_killed_worker_ends_the_run_clearly_and_resume_continues(tiny_model, tmp_path, title, named, shared_ray):
    """The run in a process of its own (its exit status and output are what is checked),
    joining the package's Ray head, whose worker it loses at step 2."""
    run = tmp_path / "run"
    path = tmp_path / "run.yaml"
    # Killing an engine needs one rank only; killing rank 1 needs two.
    ranks = ONE_RANK if title == "ray::EngineWorker" else {}
    raw = joined(run_config(tiny_model, run, **FOUR_STEPS, **ranks), shared_ray)
    path.write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "dapo_megatron", "train", str(path)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # with the head's token (shared_ray)
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while len(_logged_steps(run)) < 2:
        assert process.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.2)
    victims = _ray_workers(title)
    if title == "ray::ActorRank":
        assert len(victims) == 2, victims
        victims = victims[1:]  # the later started of the two ranks (either one's death ends the run alike)
    assert victims, f"no {title} process on the Ray head"
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
    if title != "ray::ActorRank":
        return  # resuming after a fault is one path whichever worker died; it runs once
    assert train(config_from_dict(raw), resume=True).steps == 4
    assert sorted(set(_logged_steps(run))) == [1, 2, 3, 4] and len(_logged_steps(run)) == 4


@pytest.mark.timeout(600)
def test_rewards_that_raise_or_hang_score_wrong_and_are_counted(tiny_model, tmp_path, shared_ray):
    """One prompt whose reward raises, one whose reward hangs past the bound, two normal."""
    rows = [
        {"prompt": [{"role": "user", "content": q}], "reward_model": {"ground_truth": a}}
        for q, a in (("1+2=", "3"), ("2+2=", "4"), ("3+3=", "6"), ("4+4=", "8"))
    ]
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = run_config(
        tiny_model, tmp_path / "run", **{"trainer.num_steps": 1, "trainer.val_before_train": False, **ONE_RANK}
    )
    config["data"].update(train_files=[str(train_file)], train_batch_size=1, mini_batch_size=4)
    config["trainer"]["val_every"] = 0
    config["algorithm"].update(reward_fn="tests.e2e.rewards:faulty", reward_timeout_s=1.0)
    assert train(config_from_dict(joined(config, shared_ray))).steps == 1
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    rounds = step["dynamic_sampling/rounds"]
    # Every round generates 4 responses for each prompt: 4 raise and 4 time out per round.
    assert step["reward/errors"] == 4 * rounds and step["reward/timeouts"] == 4 * rounds, step


@pytest.mark.timeout(600)
def test_steps_with_nonfinite_updates_stop_the_run_after_the_configured_count(
    tiny_model, tmp_path, monkeypatch, shared_ray
):
    """The trainer's side: updates the actor reports as non-finite (its own skip is tested in
    tests/distributed/test_trainer_actor.py) are logged and stop the run at the limit."""
    from dapo_megatron.orchestration.actor_group import ActorGroup

    real_train = ActorGroup.train

    def reported_nonfinite(self, batch, num_mini_batches, temperature):
        updates = real_train(self, batch, num_mini_batches, temperature)
        return [dataclasses.replace(u, loss=float("nan"), nonfinite=1.0, update_skipped=1.0) for u in updates]

    monkeypatch.setattr(ActorGroup, "train", reported_nonfinite)
    config = run_config(tiny_model, tmp_path / "run", **{**FOUR_STEPS, **ONE_RANK, "trainer.max_bad_steps_in_a_row": 2})
    with pytest.raises(TrainingDiverged, match="stopped at step 2: 2 steps in a row") as info:
        train(config_from_dict(joined(config, shared_ray)))
    assert "actor/nonfinite_updates=" in str(info.value) and "step_00000001 (--resume continues from it)" in str(
        info.value
    )
    assert _logged_steps(tmp_path / "run") == [1, 2]


def _from_step(step: int, monkeypatch, action) -> None:
    """Call ``action(engines)`` once, when step ``step`` starts generating (before its
    first generation call reaches the engines)."""
    from dapo_megatron.orchestration.rollout import RolloutWorkers
    from dapo_megatron.run.step import StepRunner

    current, done = {"step": 0}, []
    real_step_generate, real_generate = StepRunner._generate, RolloutWorkers.generate

    def step_generate(self, number):
        current["step"] = number
        return real_step_generate(self, number)

    def generate(self, prompts, params, n):
        if current["step"] >= step and not done:
            done.append(action(self.engines))
        return real_generate(self, prompts, params, n)

    monkeypatch.setattr(StepRunner, "_generate", step_generate)
    monkeypatch.setattr(RolloutWorkers, "generate", generate)


@pytest.mark.timeout(600)
def test_a_hung_engine_fails_the_step_within_the_bound(tiny_model, tmp_path, monkeypatch, shared_ray):
    """Engine 0 stops answering (alive, not dead) at step 2: the step fails within
    rollout.generate_timeout_s, naming the engine and the setting, instead of waiting."""
    from dapo_megatron.orchestration.group_calls import MemberTimedOut

    def hang(worker):
        import time

        time.sleep(600)

    hung = {}
    _from_step(
        2, monkeypatch, lambda engines: hung.update(at=time.monotonic(), ref=engines[0].__ray_call__.remote(hang))
    )
    config = run_config(tiny_model, tmp_path / "run", **{**FOUR_STEPS, **ONE_RANK, "rollout.generate_timeout_s": 3.0})
    with pytest.raises(
        MemberTimedOut,
        match=r"^rollout engine 0 \(pid \d+\) did not answer within 3 s "
        r"\(rollout.generate_timeout_s\): hung",
    ):
        train(config_from_dict(joined(config, shared_ray)))
    assert time.monotonic() - hung["at"] < 45  # the bound, then the hung engine is not waited for at shutdown
    assert _logged_steps(tmp_path / "run") == [1]


@pytest.mark.timeout(600)
def test_an_engine_killed_during_sync_ends_with_the_resume_hint(tiny_model, tmp_path, monkeypatch, capsys, shared_ray):
    """Engine 0's process exits inside the weight sync after step 2: the run ends with the
    one-paragraph message of a dead member (the engine named) and the --resume hint."""

    def exit_in_the_next_bucket(worker):
        import os

        worker.engine.load_weight_bucket = lambda *args: os._exit(1)

    _from_step(2, monkeypatch, lambda engines: engines[0].__ray_call__.remote(exit_in_the_next_bucket))
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(joined(run_config(tiny_model, tmp_path / "run", **FOUR_STEPS, **ONE_RANK), shared_ray))
    )
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert "dapo-megatron train: error: weight sync into the rollout engines failed: rollout engine 0 (pid " in err, (
        err[-3000:]
    )
    assert " died: " in err and "Traceback" not in err
    assert f"the last complete checkpoint is {tmp_path / 'run' / 'checkpoints' / 'step_00000001'}; add --resume" in err
