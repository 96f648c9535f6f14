"""A run's life: resume continues exactly where an uninterrupted run would be."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dapo_megatron.ckpt.dcp_io import latest_checkpoint, read_chunk, tensor_shapes
from dapo_megatron.config import ConfigError, config_from_dict
from dapo_megatron.run.resume import TRAINER_STATE
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import FOUR_STEPS, REPO, joined, run_config, step_metrics


def _tree_digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and the SHA-256 of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _stored_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {
        key: read_chunk(checkpoint, key, (0,) * len(shape), shape, dtype)
        for key, (shape, dtype) in tensor_shapes(checkpoint).items()
    }


@pytest.mark.timeout(900)
def test_two_steps_resume_two_steps_equals_four_steps(tiny_model, tmp_path, uninterrupted, shared_ray):
    whole, seen = uninterrupted
    split = tmp_path / "split"
    first_half = train(
        config_from_dict(joined(run_config(tiny_model, split, **{**FOUR_STEPS, "trainer.num_steps": 2}), shared_ray))
    )
    assert first_half.steps == 2
    saved = _tree_digest(split / "checkpoints")
    with pytest.raises(ConfigError, match="already holds checkpoints .*Pass --resume.* another checkpoint.save_dir"):
        train(config_from_dict(joined(run_config(tiny_model, split, **FOUR_STEPS), shared_ray)))
    # A new run folder whose checkpoint.save_dir holds another run's checkpoints: refused
    # before anything starts, the checkpoints untouched (it would overwrite them).
    other = run_config(tiny_model, tmp_path / "other", **FOUR_STEPS)
    other["checkpoint"]["save_dir"] = str(split / "checkpoints")
    with pytest.raises(
        ConfigError, match=f"{split / 'checkpoints'} already holds checkpoints \\(step_00000002, latest\\)"
    ):
        train(config_from_dict(joined(other, shared_ray)))
    assert _tree_digest(split / "checkpoints") == saved and not (tmp_path / "other").exists()
    result = train(config_from_dict(joined(run_config(tiny_model, split, **FOUR_STEPS), shared_ray)), resume=True)
    assert result.steps == 4 and (split / "config.resumed_at_step_2.yaml").exists()

    expected, got = step_metrics(whole), step_metrics(split)
    assert sorted(got) == [1, 2, 3, 4] == sorted(expected)
    for step in range(1, 5):
        assert got[step] == expected[step], step
    assert {"reward/score_mean", "actor/loss", "actor/grad_norm", "response/length_mean"} <= set(got[4])

    final_whole, final_split = latest_checkpoint(whole / "checkpoints"), latest_checkpoint(split / "checkpoints")
    assert final_whole.name == final_split.name == "step_00000004"
    stored_whole, stored_split = _stored_tensors(final_whole), _stored_tensors(final_split)
    assert sorted(stored_whole) == sorted(stored_split) and any("optimizer" in k for k in stored_whole)
    for key, tensor in stored_whole.items():
        assert torch.equal(tensor, stored_split[key]), key
    # The exported final policy is the engine's (synced after the last update) in HF form.
    from safetensors.torch import load_file

    exported = load_file(whole / "hf_final" / "model.safetensors")
    assert (whole / "hf_final" / "config.json").exists() and (whole / "hf_final" / "tokenizer.json").exists()
    assert sorted(exported) == sorted(seen["engine"])
    assert all(torch.equal(exported[name], seen["engine"][name]) for name in exported)
    state_whole = json.loads((final_whole / TRAINER_STATE).read_text())
    assert state_whole == json.loads((final_split / TRAINER_STATE).read_text())
    assert state_whole["step"] == 4 and state_whole["data"]["position"] > 0

    # At another layout (tp 1 x pp 2 instead of tp 2), from checkpoint.load_dir (a new run
    # folder has no checkpoint of its own): the same step and data position.
    relaid = tmp_path / "relaid"
    other = run_config(tiny_model, relaid, **FOUR_STEPS)
    other["parallel"].update(tp_size=1, pp_size=2)
    other["checkpoint"]["load_dir"] = str(whole / "checkpoints" / "step_00000002")
    train(config_from_dict(joined(other, shared_ray)), resume=True)
    assert sorted(step_metrics(relaid)) == [3, 4]
    state = json.loads((latest_checkpoint(relaid / "checkpoints") / TRAINER_STATE).read_text())
    assert state["step"] == 4 and state["data"] == state_whole["data"]


def test_resume_without_a_checkpoint_is_refused(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="nothing to resume: no checkpoint in the run's checkpoint folder"):
        train(config_from_dict(run_config(tiny_model, tmp_path / "fresh", **FOUR_STEPS)), resume=True)


@pytest.mark.timeout(900)
def test_a_stop_signal_during_a_long_generation_saves_within_a_bound(tiny_model, tmp_path, uninterrupted, shared_ray):
    """SIGUSR1 after step 1 while step 2's generation hangs for 120 s (and a SIGTERM while
    the run stops): the generation is abandoned, step 1 is saved and the run exits 75
    within 30 s; ``--resume`` takes step 2 whole and continues as an uninterrupted run.
    The stopped run is a process of its own (the signals' target), on the package's Ray
    head; the resume runs here."""
    run = tmp_path / "preempted"
    config = joined(run_config(tiny_model, run, **{**FOUR_STEPS, "checkpoint.save_every": 4}), shared_ray)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # with the head's token (shared_ray)
    slow = [sys.executable, "-m", "tests.e2e.slow_generation", "train", str(path)]
    process = subprocess.Popen(slow, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and process.poll() is None:
        assert time.monotonic() < deadline, "the run logged no step"
        time.sleep(0.2)
    start = time.monotonic()
    process.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)  # a second signal must not break the save
    output, _ = process.communicate(timeout=300)
    stopped_after = time.monotonic() - start
    assert process.returncode == 75, output
    assert stopped_after < 30, f"stopped {stopped_after:.0f} s after the signal"
    assert "received SIGTERM again: already stopping" in output
    assert "stopped by SIGUSR1 after step 1 (step 2's generation abandoned" in output, output[-3000:]
    checkpoint = latest_checkpoint(run / "checkpoints")
    assert checkpoint.name == "step_00000001"
    assert sorted(step_metrics(run)) == [1]
    print(f"stopped {stopped_after:.1f} s after the signal, at step 1")

    train(config_from_dict(config), resume=True)
    expected, got = step_metrics(uninterrupted[0]), step_metrics(run)
    assert sorted(got) == [1, 2, 3, 4]
    for step in range(1, 5):  # step 2 drew the prompts it would have drawn, with the same seeds
        assert got[step] == expected[step], step
