"""The console: each step's line with an ETA from this process's own pace, and the run's
summary at the end (steps and time, validation first/best/last, where everything went)."""

from __future__ import annotations

import io
from pathlib import Path

from dapo_megatron.config import Config, LoggingConfig
from dapo_megatron.run import metrics_log
from dapo_megatron.run.metrics_log import MetricsLogger, duration
from dapo_megatron.run.trainer import TrainResult


def test_durations_read_as_people_write_them():
    assert [duration(s) for s in (0, 45.4, 185, 3599, 7620)] == ["0s", "45s", "3m05s", "59m59s", "2h07m"]


def test_the_eta_is_this_processs_pace_times_the_steps_left(tmp_path, monkeypatch):
    clock = iter([100.0, 130.0, 190.0, 220.0])  # start, then one reading per line
    monkeypatch.setattr(metrics_log.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    # A run resumed after step 4 of 10: its pace is counted from step 5 on.
    with MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), 10, stream, resume_after=4) as log:
        log.log(5, {"reward/score_mean": 0.5})  # 30 s for 1 step, 5 left
        log.log(6, {"val/accuracy": 0.5}, console=True)  # a validation line: no ETA
        log.log(10, {"reward/score_mean": 0.5})  # the last step: none
    first, validation, last = stream.getvalue().splitlines()
    assert first.endswith("elapsed 30s  eta 2m30s"), first
    assert "eta" not in validation and "validation" in validation
    assert last.endswith("elapsed 120s"), last


def test_the_summary_says_steps_time_validations_and_where_everything_went(tmp_path):
    config = Config()
    config.trainer.output_dir = str(tmp_path / "run")
    result = TrainResult(
        tmp_path / "run",
        40,
        0.55,
        0.98,
        str(tmp_path / "run/checkpoints/step_00000040"),
        seconds=95.2,
        validations=[(0, 0.55), (10, 0.89), (20, 0.99), (30, 0.99), (40, 0.98)],
        hf_export=tmp_path / "run/hf_final",
    )
    run = Path(tmp_path / "run")
    assert result.summary(config) == [
        f"trained 40 steps in 1m35s; run folder {run}; validation accuracy 55.0% -> 98.0%",
        "validation accuracy: first 55.0% (step 0), best 99.0% (step 20), last 98.0% (step 40)",
        f"checkpoints: {run / 'checkpoints'} (last: step_00000040); HF export: {run / 'hf_final'}",
        f"wrote: metrics.jsonl {run / 'metrics.jsonl'}; TensorBoard {run / 'tensorboard'} "
        f"(tensorboard --logdir {run / 'tensorboard'}); rollout records {run / 'rollouts'}",
    ]
    config.logging.tensorboard, config.logging.rollout_records_every = False, 0
    quiet = TrainResult(run, 2, None, None, None, seconds=3)
    assert quiet.summary(config) == [
        f"trained 2 steps in 3s; run folder {run}",
        f"checkpoints: {run / 'checkpoints'} (none written)",
        f"wrote: metrics.jsonl {run / 'metrics.jsonl'}",
    ]
