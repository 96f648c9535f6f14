"""A training job's whole life on the real one-node SLURM (conftest.py), each step as a
user meets it: `convert.sbatch`, then `train.sbatch` on the CPU demo recipe (a tiny model
and the demo's task) to the end; the time limit's USR1 (also during start-up), a
preemption by a higher-priority partition under proctrack/cgroup and proctrack/linuxproc,
each ending in a requeue whose resumed run equals an uninterrupted one, metric for metric;
and `scancel`, after which nothing of the job is left.

The time limit's signal is sent as SLURM sends it (`--signal=B:USR1@N`: USR1 to the batch
shell only) with `scancel --batch --signal=USR1`, at the moment the test chooses: SLURM's
own timer fires up to 30 s early, which would make the moment a matter of luck.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import TIMING_PREFIXES, tiny_qwen2_task
from tests.slurm.conftest import Partition

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "examples" / "qwen2_5_32b"
STEPS = 3
JOB_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    """A random tiny Qwen2 with the demo's tokenizer, and the demo's addition task."""
    return tiny_qwen2_task(tmp_path_factory.mktemp("slurm_task"))


def _overrides(task: Path) -> list[str]:
    """The demo recipe, made small: the tiny model, 3 steps of 4 prompts, a checkpoint
    every step, no validation, the tests' reward."""
    return [
        f"model.hf_config={task / 'model'}",
        f"model.hf_weights={task / 'model'}",
        f"data.train_files=[{task / 'data' / 'train.jsonl'}]",
        "data.val_files=[]",
        "data.train_batch_size=4",
        "data.gen_batch_size=4",
        "data.mini_batch_size=8",
        "rollout.n_samples_per_prompt=4",
        f"trainer.num_steps={STEPS}",
        "trainer.micro_batch_max_tokens=64",
        "trainer.val_before_train=false",
        "trainer.val_every=0",
        "checkpoint.save_every=1",
        "checkpoint.export_hf=false",
        # A reward that gives every group right and wrong answers (the random model solves nothing).
        "algorithm.reward_fn=tests.e2e.rewards:mixed_for_even_answers",
    ]


def _export(**env: str) -> str:
    return "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())])


def _submit(slurm, task: Path, run: Path, *options: str, **env: str) -> str:
    """`sbatch train.sbatch` of the small demo into ``run``, from the repository's root."""
    run.mkdir(parents=True, exist_ok=True)
    settings = _export(RECIPE="examples/demo/demo.yaml", OUTPUT_DIR=str(run), REHEARSE="0", PYTHONPATH=str(ROOT), **env)
    return slurm.sbatch(
        SCRIPTS / "train.sbatch",
        *_overrides(task),
        options=("--nodes=1", "--gpus-per-node=0", "--time=60", f"--output={run}/dapo-%j.out", settings, *options),
        cwd=ROOT,
    )


def _metrics(run: Path) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        step = row.pop("step")
        assert step not in steps, f"step {step} logged twice"
        steps[step] = {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}
    return steps


def _wait_for_step(slurm, job_id: str, run: Path, step: int) -> None:
    """Until ``run`` has logged ``step`` (the job still running)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines())):
        job = slurm.job(job_id)
        assert job["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), (job, _logs(run))
        assert time.monotonic() < deadline, f"job {job_id} logged no step {step}\n{_logs(run)}"
        time.sleep(0.5)


def _logs(run: Path) -> str:
    """Every log of the job's attempts, for a failure's message."""
    parts = []
    for path in sorted(run.glob("dapo-*.out")) + sorted(run.glob("logs/*/attempt-*/*.log")):
        parts.append(
            f"--- {path.relative_to(run)} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
        )
    return "\n".join(parts)


def _job_processes(job_id: str) -> list[psutil.Process]:
    """Processes whose environment says they belong to the job (its steps and their children)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("SLURM_JOB_ID") == job_id:
                found.append(process)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, task, tmp_path_factory) -> tuple[Path, Path]:
    """`convert.sbatch` of the tiny model, then `train.sbatch` from the converted
    checkpoint to the end: the run folder and the checkpoint."""
    slurm = slurm_cluster
    root = tmp_path_factory.mktemp("uninterrupted")
    converted = root / "tiny_mcore"
    options = ("--cpus-per-task=1", "--mem=2G", f"--output={root}/convert-%j.out")
    env = _export(RECIPE="examples/demo/demo.yaml", MODEL_DIR=str(task / "model"), OUTPUT_DIR=str(root))
    job = slurm.wait(
        slurm.sbatch(SCRIPTS / "convert.sbatch", "--out", str(converted), options=(*options, env), cwd=ROOT),
        timeout=JOB_TIMEOUT_S,
    )
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), slurm.output(job)
    run = root / "run"
    job = slurm.wait(_submit(slurm, task, run, MEGATRON_CKPT=str(converted)), timeout=JOB_TIMEOUT_S)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), _logs(run)
    return run, converted


def test_convert_then_train_the_demo_to_the_end(uninterrupted):
    run, converted = uninterrupted
    assert sorted(_metrics(run)) == list(range(1, STEPS + 1))
    assert json.loads((run / "checkpoints" / "latest").read_text())["step"] == STEPS
    assert (converted / "latest").exists() or any(converted.glob("*.distcp"))
    assert not list(run.glob(".ray_auth_token_*"))  # the job's token is gone with it


def _assert_resumed_equals(run: Path, reference: Path, job: dict, restarts: int) -> None:
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", str(restarts)), _logs(run)
    expected, got = _metrics(reference), _metrics(run)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step] == expected[step], step
    attempts = sorted(p.name for p in (run / "logs").glob("*/attempt-*"))
    assert len(attempts) == restarts + 1 and all((run / "logs").glob(f"*/{a}/train.log") for a in attempts)


def test_the_time_limit_and_a_signal_during_start_up_requeue_and_resume(slurm, task, tmp_path, uninterrupted):
    """USR1 to the batch shell while the job starts (before the trainer runs), then again
    after step 1: each time the job requeues itself, and the run ends as the uninterrupted
    one did."""
    run = tmp_path / "run"
    job_id = _submit(slurm, task, run, MEGATRON_CKPT=str(uninterrupted[1]))
    slurm.wait(job_id, timeout=JOB_TIMEOUT_S, states={"RUNNING"})
    head_log = None
    deadline = time.monotonic() + 60
    while head_log is None:  # Ray's head is starting: the trainer is not running yet
        head_log = next(iter(run.glob("logs/*/attempt-0/ray-head-*.log")), None)
        assert time.monotonic() < deadline, _logs(run)
        time.sleep(0.2)
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)
    _wait_for_step(slurm, job_id, run, 1)
    assert slurm.job(job_id)["Restarts"] == "1"
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)
    job = slurm.wait(job_id, timeout=JOB_TIMEOUT_S)
    _assert_resumed_equals(run, uninterrupted[0], job, restarts=2)


def _preemption(grace_time: int) -> dict:
    """Two partitions: jobs of `high` preempt those of `low` (requeued after ``grace_time`` s)."""
    return dict(
        partitions=(
            Partition("low", default=True, priority_tier=1, preempt_mode="REQUEUE", grace_time=grace_time),
            Partition("high", priority_tier=2),
        ),
        preempt_type="preempt/partition_prio",
        preempt_mode="REQUEUE",
    )


@pytest.mark.parametrize(
    "proctrack",
    [
        # The trainer saves within the grace time (a few seconds here).
        pytest.param("cgroup", marks=pytest.mark.slurm_config(proctrack="cgroup", **_preemption(30))),
        # Ray dies with the preemption's SIGTERM, nothing can be saved: the grace only delays the requeue.
        # (About a minute on 2 cores: outside the 15-minute suite, `make test-slurm-extended`.)
        pytest.param(
            "linuxproc",
            marks=[
                pytest.mark.slurm_config(proctrack="linuxproc", **_preemption(10)),
                pytest.mark.skipif(
                    not os.environ.get("DAPO_TEST_SLURM_EXTENDED"),
                    reason="the linuxproc preemption runs with DAPO_TEST_SLURM_EXTENDED=1 (make test-slurm-extended)",
                ),
            ],
        ),
    ],
)
def test_a_preemption_requeues_and_resumes(slurm, task, tmp_path, uninterrupted, proctrack):
    """A job of a higher-priority partition takes the node after step 1: the training job
    is requeued (after saving, where its Ray survives the preemption's SIGTERM; from its
    last periodic checkpoint where it does not) and ends as the uninterrupted run did."""
    run = tmp_path / "run"
    job_id = _submit(slurm, task, run, "--partition=low", MEGATRON_CKPT=str(uninterrupted[1]))
    _wait_for_step(slurm, job_id, run, 1)
    urgent = tmp_path / "urgent.sh"
    urgent.write_text("#!/bin/bash\nsleep 2\n")
    urgent_id = slurm.sbatch(
        urgent, options=("--partition=high", "--exclusive", f"--output={tmp_path}/urgent.out"), cwd=tmp_path
    )
    assert slurm.wait(urgent_id, timeout=JOB_TIMEOUT_S)["JobState"] == "COMPLETED"
    job = slurm.wait(job_id, timeout=JOB_TIMEOUT_S)
    _assert_resumed_equals(run, uninterrupted[0], job, restarts=1)


def test_scancel_leaves_nothing_of_the_job(slurm, task, tmp_path, uninterrupted):
    run = tmp_path / "run"
    job_id = _submit(slurm, task, run, MEGATRON_CKPT=str(uninterrupted[1]))
    _wait_for_step(slurm, job_id, run, 1)
    assert list(run.glob(".ray_auth_token_*")) and _job_processes(job_id)
    slurm.run("scancel", job_id)
    job = slurm.wait(job_id, timeout=120)
    assert job["JobState"] == "CANCELLED", job
    deadline = time.monotonic() + 30
    while _job_processes(job_id):
        assert time.monotonic() < deadline, [p.cmdline() for p in _job_processes(job_id)]
        time.sleep(0.5)
    assert not list(run.glob(".ray_auth_token_*")), "the job's Ray token file was left behind"
