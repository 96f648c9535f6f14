"""`train.sbatch` executed, signals included: stand-ins for `srun`, `scontrol`, `ray` and
`dapo-megatron` on PATH run every step of the script on this machine, so the time-limit
signal's path (USR1 to the batch shell, forwarded to the trainer, which saves while the
`ray start` steps are still up, then requeue) runs for real, not only as printed text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "qwen2_5_32b" / "train.sbatch"

# Runs the step's command on this machine, its output to --output (as srun would); the
# Ray GPU wait succeeds at once. exec: a signal sent to "srun" reaches the command, as
# srun forwards USR1 and TERM to its tasks.
SRUN = r"""#!/usr/bin/env bash
out=/dev/null
while [[ $# -gt 0 && "$1" == -* ]]; do
  case "$1" in
    --output=*) out="${1#--output=}" ;;
    -w) shift ;;
  esac
  shift
done
if [[ "$1" == python3 && "$*" == *cluster_resources* ]]; then exit 0; fi
exec "$@" >>"$out" 2>&1
"""

SCONTROL = r"""#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") tr ',' '\n' <<<"$3" ;;
  "show config") printf 'PreemptMode             = REQUEUE\nPreemptParameters       = %s\nPreemptType             = %s\n' \
                   "${FAKE_PREEMPT_PARAMETERS:-(null)}" "${FAKE_PREEMPT_TYPE:-preempt/none}" ;;
  requeue*) echo "$*" >>"$STATE_DIR/scontrol.log" ;;
esac
"""

# `ray start ... --block`: stays up until TERM, recording its start and its stop.
RAY = r"""#!/usr/bin/env bash
echo $$ >>"$STATE_DIR/ray.pids"
trap 'echo $$ >>"$STATE_DIR/ray.stopped"; exit 0' TERM
while true; do sleep 0.1; done
"""

# `dapo-megatron plan` accepts; `train` waits for a signal, then "saves" (records which
# ray steps are alive at that moment) and exits 75 as the real trainer does.
TRAINER = r"""#!{python}
import os, signal, sys, time
state = os.environ["STATE_DIR"]
if sys.argv[1] == "plan":
    sys.exit(0)
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append("USR1"))
signal.signal(signal.SIGTERM, lambda s, f: got.append("TERM"))
open(os.path.join(state, "train.args"), "w").write(" ".join(sys.argv[1:]))
open(os.path.join(state, "train.pid"), "w").write(str(os.getpid()))
while not got:
    time.sleep(0.05)
time.sleep(0.5)  # the step finishes and the checkpoint is written
alive = []
for pid in open(os.path.join(state, "ray.pids")).read().split():
    try:
        os.kill(int(pid), 0)
        alive.append(pid)
    except ProcessLookupError:
        pass
open(os.path.join(state, "saved"), "w").write(f"{got[0]} {len(alive)}")
sys.exit(75)
"""


@pytest.fixture
def cluster_stand_ins(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, text in (
        ("srun", SRUN),
        ("scontrol", SCONTROL),
        ("ray", RAY),
        ("dapo-megatron", TRAINER.replace("{python}", sys.executable)),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STATE_DIR": str(state),
        "SLURM_JOB_NODELIST": "gpu-007,gpu-008,gpu-009",
        "SLURM_NNODES": "3",
        "SLURM_JOB_ID": "99",
        "MODEL_DIR": str(tmp_path / "model"),
        "DATA_DIR": str(tmp_path / "data"),
        "OUTPUT_DIR": str(tmp_path / "run"),
    }
    return env, state


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def _start(env):
    return subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_time_limit_signal_saves_while_ray_is_up_then_requeues(cluster_stand_ins):
    """USR1 to the batch shell only (`--signal=B:USR1@300`): the trainer gets it and saves
    while all 3 `ray start` steps are alive; then the job is requeued and Ray stopped."""
    env, state = cluster_stand_ins
    job = _start(env)
    _wait_for(state / "train.pid")
    assert len((state / "ray.pids").read_text().split()) == 3
    job.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert (state / "saved").read_text() == "USR1 3"  # every Ray node still up at the save
    assert (state / "scontrol.log").read_text().split() == ["requeue", "99"]
    assert sorted((state / "ray.stopped").read_text().split()) == sorted((state / "ray.pids").read_text().split())
    assert "requeueing job 99" in err
    assert not any(Path(env["OUTPUT_DIR"]).glob(".ray_auth_token_*"))  # the job's token removed


def test_a_requeue_that_fails_still_ends_the_saved_run_cleanly(cluster_stand_ins):
    """Preemption with PreemptMode=REQUEUE requeues the job itself; `scontrol requeue`
    may then fail: the checkpoint is written, so the script says so and exits 0."""
    env, state = cluster_stand_ins
    failing = Path(env["PATH"].split(":", 1)[0]) / "scontrol"
    failing.write_text(SCONTROL.replace('requeue*) echo "$*" >>"$STATE_DIR/scontrol.log" ;;', "requeue*) exit 1 ;;"))
    job = _start(env)
    _wait_for(state / "train.pid")
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "could not requeue job 99" in err and "--resume" in err


@pytest.mark.parametrize(
    "preempt_type, parameters, warned",
    [
        ("preempt/partition_prio", "(null)", True),
        ("preempt/qos", "send_user_signal,min_exempt_priority=5", False),
        ("preempt/none", "(null)", False),
    ],
)
def test_the_job_says_when_preemption_cannot_reach_the_trainer_first(
    cluster_stand_ins, preempt_type, parameters, warned
):
    """Without PreemptParameters=send_user_signal, Slurm preempts by sending SIGTERM to every
    process of every step: Ray's raylets and workers exit on it, so no checkpoint can be
    written; the job log says so at start (and what to ask for)."""
    env, state = cluster_stand_ins
    env = {**env, "FAKE_PREEMPT_TYPE": preempt_type, "FAKE_PREEMPT_PARAMETERS": parameters}
    job = _start(env)
    _wait_for(state / "train.pid")
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert ("PreemptParameters=send_user_signal" in err) == warned, err
    if warned:
        assert f"PreemptType={preempt_type}" in err and "checkpoint.save_every" in err
