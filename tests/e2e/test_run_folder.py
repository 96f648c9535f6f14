"""A run folder's life when things go wrong: damaged checkpoints are named (with the
previous complete one offered, and ``--resume-from`` continuing from it), a finished run
is not run again, a folder whose attempt left no checkpoint is reused, refused runs
write nothing, a GPU layout on a machine without GPUs fails at once, and a signal during
start-up ends it at once without leaving Ray's token behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from dapo_megatron.cli import main
from dapo_megatron.config import ConfigError, config_from_dict
from dapo_megatron.orchestration import group_calls
from dapo_megatron.orchestration.cluster import TOKEN_FILE
from dapo_megatron.run.resume import TRAINER_STATE
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import ONE_RANK, REPO, joined, run_config, step_metrics

QUIET = {"trainer.val_before_train": False, "trainer.val_every": 0}


def _tokens(run: Path) -> list[Path]:
    """Ray token files of the run's instance: in the run folder, or in the short folder its
    ``ray`` link points at (a long run path would overflow Ray's socket names)."""
    folders = [run, *(link.resolve() for link in run.glob("ray*") if link.is_symlink())]
    return [token for folder in folders for token in folder.rglob(TOKEN_FILE)]


def _steps_logged(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_damaged_checkpoints_are_named_and_the_previous_one_continues(tiny_model, tmp_path, capsys, shared_ray):
    run = tmp_path / "run"
    raw = run_config(tiny_model, run, **{**QUIET, **ONE_RANK, "trainer.num_steps": 3, "checkpoint.save_every": 1})
    joined(raw, shared_ray)
    raw["checkpoint"]["keep_last"] = 0
    train(config_from_dict(raw))
    saves = run / "checkpoints"
    step2, step3 = saves / "step_00000002", saves / "step_00000003"
    assert (saves / "step_00000001").is_dir() and step2.is_dir() and step3.is_dir()

    # A finished run resumed: nothing starts, nothing is logged again (no second validation).
    before = (run / "metrics.jsonl").read_text()
    assert train(config_from_dict(raw), resume=True).already_complete
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path), "--resume"]) == 0
    assert f"is complete: its checkpoint {step3} is at step 3 of trainer.num_steps=3" in capsys.readouterr().out
    assert (run / "metrics.jsonl").read_text() == before and not list(run.glob("config.resumed_at_step_*"))

    # A refused resume (a setting its data position depends on changed) writes nothing.
    longer = run_config(tiny_model, run, **{**QUIET, **ONE_RANK, "trainer.num_steps": 4, "checkpoint.save_every": 1})
    joined(longer, shared_ray)
    changed = json.loads(json.dumps(longer))
    changed["data"]["seed"] = 7
    with pytest.raises(ConfigError, match="data.seed=7 .saved with 42."):
        train(config_from_dict(changed), resume=True)
    assert not list(run.glob("config.resumed_at_step_*"))

    offer = rf"the previous complete checkpoint is {step2} \(step 2\): continue from it with `--resume-from {step2}`"
    # A truncated shard of the latest checkpoint: the file, its size, the offer; in
    # milliseconds (before Ray starts), not as an EOFError in the ranks.
    shard = max(step3.glob("*.distcp"), key=lambda p: p.stat().st_size)
    intact = shard.read_bytes()
    shard.write_bytes(intact[: len(intact) // 2])
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"{shard} is truncated: .* bytes, its index needs .*; {offer}"):
        train(config_from_dict(longer), resume=True)
    assert time.monotonic() - start < 10
    # An empty trainer_state.json, then a truncated `latest`.
    shard.write_bytes(intact)
    state = (step3 / TRAINER_STATE).read_text()
    (step3 / TRAINER_STATE).write_text("")
    with pytest.raises(ConfigError, match=rf"{step3 / TRAINER_STATE} is damaged .*; {offer}"):
        train(config_from_dict(longer), resume=True)
    (step3 / TRAINER_STATE).write_text(state)
    latest = (saves / "latest").read_text()
    (saves / "latest").write_text(latest[:5])
    newest = rf"the previous complete checkpoint is {step3} \(step 3\)"
    with pytest.raises(ConfigError, match=rf"{saves / 'latest'} is damaged .*; {newest}"):
        train(config_from_dict(longer), resume=True)
    (saves / "latest").write_text(latest)

    # Damaged again; continue from step 2 as offered, on the command line with an
    # override after the option: step 3 runs again and step 4 follows; the damaged
    # checkpoint is kept aside, out of keep_last's count, and `latest` names the new one.
    shard.write_bytes(intact[:100])
    path.write_text(yaml.safe_dump({**longer, "checkpoint": {**longer["checkpoint"], "keep_last": 2}}))
    assert main(["train", str(path), "--resume-from", str(step2), "trainer.num_steps=4"]) == 0
    assert _steps_logged(run) == [1, 2, 3, 4]
    (superseded,) = saves.glob("superseded-*")
    assert sorted(p.name for p in superseded.iterdir()) == ["step_00000003"]
    assert (superseded / "step_00000003" / shard.name).stat().st_size == 100
    assert sorted(p.name for p in saves.glob("step_*")) == ["step_00000003", "step_00000004"]
    assert json.loads((saves / "latest").read_text())["path"] == "step_00000004"
    assert (run / "config.resumed_at_step_2.yaml").exists()


@pytest.mark.timeout(600)
def test_a_run_folder_whose_attempt_left_no_checkpoint_is_reused(tiny_model, tmp_path, shared_ray):
    run = tmp_path / "run"
    raw = run_config(tiny_model, run, **{**QUIET, **ONE_RANK, "trainer.num_steps": 1, "checkpoint.save_every": 0})
    joined(raw, shared_ray)
    train(config_from_dict(raw))
    first = step_metrics(run)
    assert not (run / "checkpoints").exists()
    # --resume has nothing to resume and says to start without it; started so, the run
    # reuses the folder, keeping the earlier attempt's files aside.
    with pytest.raises(ConfigError, match="nothing to resume.*start the run without --resume .a run folder without"):
        train(config_from_dict(raw), resume=True)
    train(config_from_dict(raw))
    (aside,) = run.glob("earlier-attempt-*")
    assert sorted(p.name for p in aside.iterdir()) == ["config.yaml", "metrics.jsonl", "tensorboard"]
    assert _steps_logged(run) == [1] and step_metrics(aside) == first == step_metrics(run)


def test_a_gpu_layout_without_gpus_fails_at_once_and_leaves_no_token(tiny_model, tmp_path):
    run = tmp_path / "run"
    raw = run_config(tiny_model, run, **QUIET)
    raw["parallel"]["device"] = "cuda"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"parallel.device=cuda, but the Ray cluster has no GPUs \(1 node\(s\): "):
        train(config_from_dict(raw))
    assert time.monotonic() - start < 60
    assert not _tokens(run) and not (run / "config.yaml").exists()


@pytest.mark.timeout(300)
def test_engines_that_cannot_be_placed_fail_within_the_bound(tiny_model, tmp_path, monkeypatch):
    """The actor's two ranks take both CPUs of a 2-CPU instance, so the engine (1 CPU)
    can never start: the run fails naming it instead of waiting forever."""
    monkeypatch.setattr(group_calls, "SCHEDULE_TIMEOUT_S", 3.0)
    raw = run_config(tiny_model, tmp_path / "run", **QUIET)
    raw["ray"] = {"num_cpus": 2}
    start = time.monotonic()
    with pytest.raises(group_calls.MemberFailed) as caught:
        train(config_from_dict(raw))
    assert time.monotonic() - start < 120
    message = str(caught.value)
    assert message.startswith("1 of 1 rollout engine(s) not started after 3 s (rollout engine 0)"), message
    assert "(each asks for num_cpus 1, num_gpus 0); the cluster has 0 CPU free of 2, 0 GPU free of 0" in message, (
        message
    )
    assert not _tokens(tmp_path / "run")


def test_more_nodes_than_a_local_instance_has_fail_at_once(tiny_model, tmp_path):
    raw = run_config(tiny_model, tmp_path / "run", **QUIET)
    raw["parallel"].update(num_nodes=2, num_devices_per_node=1, tp_size=1)
    with pytest.raises(RuntimeError, match=r"needs 2 node\(s\) with \{'CPU': 1\} each .* has 1 such node\(s\) of 1"):
        train(config_from_dict(raw))


@pytest.mark.timeout(300)
def test_a_signal_during_start_up_ends_it_at_once_without_the_token(tiny_model, tmp_path):
    run = tmp_path / "run"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config(tiny_model, run, **QUIET)))
    command = [sys.executable, "-m", "dapo_megatron", "train", str(path)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    placing = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if "placing the actor's" in line:
                placing.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert placing.wait(120), "".join(lines)
    assert _tokens(run)  # the local instance is up, with its token
    process.send_signal(signal.SIGTERM)
    start = time.monotonic()
    process.wait(timeout=120)
    reader.join(10)
    output = "".join(lines)
    assert process.returncode == 128 + signal.SIGTERM, output
    assert time.monotonic() - start < 60
    assert "received SIGTERM while the run was starting; everything it started was stopped" in output
    assert not _tokens(run) and not (run / "metrics.jsonl").exists()
    shutil.rmtree(run, ignore_errors=True)
