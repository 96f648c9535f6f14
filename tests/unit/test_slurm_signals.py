"""`train.sbatch` executed, signals included: stand-ins for `srun`, `scontrol`, `ray` and
`dapo-megatron` on PATH run every step of the script on this machine, and the tests
signal it as SLURM does (at the time limit: USR1 to the batch shell only; at preemption:
SIGTERM to the task of every step), so the path that must keep Ray up while the trainer
saves runs for real, not only as printed text."""

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

# A step: its task runs in a process group of its own (the step's container), output to
# --output; the task's pid is recorded for the tests to signal as slurmd would. As srun
# does, USR1 is forwarded as-is and TERM as SIGKILL to the whole step. The Ray GPU wait
# succeeds at once.
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
setsid "$@" >>"$out" 2>&1 &
task=$!
echo "$task" >>"$STATE_DIR/steps"
trap 'kill -USR1 "$task"' USR1
trap 'kill -KILL -- "-$task"' TERM
while kill -0 "$task" 2>/dev/null; do wait "$task"; done
wait "$task"
"""

SCONTROL = r"""#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") tr ',' '\n' <<<"$3" ;;
  "show config") printf '%s = %s\n' PreemptType "${FAKE_PREEMPT_TYPE:-preempt/none}" \
                   PreemptParameters "${FAKE_PREEMPT_PARAMETERS:-(null)}" ProctrackType proctrack/cgroup \
                   SignalChildrenProcesses "${FAKE_SIGNAL_CHILDREN:-no}" ;;
  "show partition") echo "PartitionName=gpu GraceTime=${FAKE_GRACE_TIME:-600} PreemptMode=REQUEUE" ;;
  requeue*) echo "$*" >>"$STATE_DIR/scontrol.log" ;;
esac
"""

# `ray start ... --block`: up until signalled; like Ray, shuts down on SIGTERM.
RAY = r"""#!/usr/bin/env bash
echo $$ >>"$STATE_DIR/ray.pids"
trap 'exit 0' TERM
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


def _start(env, script: Path = SCRIPT):
    return subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _pids(path: Path) -> list[int]:
    return [int(pid) for pid in path.read_text().split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _preempt(state: Path) -> None:
    """What slurmd does at preemption (proctrack/cgroup, SignalChildrenProcesses=no):
    SIGTERM to the task of every step still running, not to the batch shell."""
    for task in _pids(state / "steps"):
        if _alive(task):
            os.kill(task, signal.SIGTERM)


def _finish(job, state: Path) -> str:
    """The job's stderr once it has ended; checks it saved with all 3 Ray nodes up, then stopped Ray."""
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    saved = (state / "saved").read_text()
    assert saved.endswith(" 3"), f"Ray nodes alive when the trainer saved: {saved}"
    deadline = time.monotonic() + 10  # SIGKILLed processes linger until reaped
    while any(_alive(pid) for pid in _pids(state / "ray.pids")):
        assert time.monotonic() < deadline, "Ray left running"
        time.sleep(0.05)
    assert not any((state.parent / "run").glob(".ray_auth_token_*"))  # the job's token removed
    return err


def test_the_time_limit_signal_saves_while_ray_is_up_then_requeues(cluster_stand_ins):
    """USR1 to the batch shell only (`--signal=B:USR1@300`): the trainer gets it and saves
    while all 3 `ray start` steps are up; then the job is requeued and Ray stopped."""
    env, state = cluster_stand_ins
    job = _start(env)
    _wait_for(state / "train.pid")
    assert len(_pids(state / "ray.pids")) == 3
    job.send_signal(signal.SIGUSR1)
    err = _finish(job, state)
    assert (state / "saved").read_text() == "USR1 3"
    assert (state / "scontrol.log").read_text().split() == ["requeue", "99"]
    assert "requeueing job 99" in err


def test_a_preemption_sigterm_to_every_step_leaves_ray_up_until_the_trainer_has_saved(cluster_stand_ins):
    """SIGTERM to every step's task: the trainer's saves; each `ray start` is the child of
    a task that ignores it, so every Ray node is up at the save (a `ray start` run as the
    task itself shuts down at once: the negative control)."""
    env, state = cluster_stand_ins
    job = _start(env)
    _wait_for(state / "train.pid")
    _preempt(state)
    _finish(job, state)
    assert (state / "saved").read_text() == "TERM 3"

    copy = Path(env["STATE_DIR"]).parent / "unshielded" / "examples" / "qwen2_5_32b"
    copy.mkdir(parents=True)
    for name in ("slurm_common.sh", "dapo.yaml"):  # the script checks that its recipe is there
        (copy / name).write_text((SCRIPT.parent / name).read_text())
    unshielded = copy / "train.sbatch"
    unshielded.write_text(SCRIPT.read_text().replace('"${RAY_STEP[@]}" ray start', "ray start"))
    for name in ("saved", "train.pid", "steps", "ray.pids"):
        (state / name).unlink()
    job = _start(env, unshielded)
    _wait_for(state / "train.pid")
    _preempt(state)
    job.communicate(timeout=60)
    assert (state / "saved").read_text() == "TERM 0"


def test_a_sigterm_to_the_batch_shell_reaches_the_trainer_as_usr1(cluster_stand_ins):
    """srun turns a forwarded SIGTERM into SIGKILL: the script forwards USR1 instead."""
    env, state = cluster_stand_ins
    job = _start(env)
    _wait_for(state / "train.pid")
    job.send_signal(signal.SIGTERM)
    _finish(job, state)
    assert (state / "saved").read_text() == "USR1 3"


def test_a_requeue_that_fails_still_ends_the_saved_run_cleanly(cluster_stand_ins):
    """Preemption with PreemptMode=REQUEUE requeues the job itself; `scontrol requeue`
    may then fail: the checkpoint is written, so the script says so and exits 0."""
    env, state = cluster_stand_ins
    failing = Path(env["PATH"].split(":", 1)[0]) / "scontrol"
    failing.write_text(SCONTROL.replace('requeue*) echo "$*" >>"$STATE_DIR/scontrol.log" ;;', "requeue*) exit 1 ;;"))
    job = _start(env)
    _wait_for(state / "train.pid")
    _preempt(state)
    err = _finish(job, state)
    assert "could not requeue job 99" in err and "--resume" in err


@pytest.mark.parametrize(
    "settings, warned",
    [
        ({"FAKE_PREEMPT_TYPE": "preempt/partition_prio"}, ()),
        ({"FAKE_PREEMPT_TYPE": "preempt/qos", "FAKE_SIGNAL_CHILDREN": "yes"}, ("SignalChildrenProcesses=yes",)),
        (
            {
                "FAKE_PREEMPT_TYPE": "preempt/qos",
                "FAKE_SIGNAL_CHILDREN": "yes",
                "FAKE_PREEMPT_PARAMETERS": "send_user_signal,min_exempt_priority=5",
            },
            (),
        ),
        ({"FAKE_PREEMPT_TYPE": "preempt/partition_prio", "FAKE_GRACE_TIME": "0"}, ("GraceTime=0",)),
        ({"FAKE_PREEMPT_TYPE": "preempt/none", "FAKE_SIGNAL_CHILDREN": "yes", "FAKE_GRACE_TIME": "0"}, ()),
    ],
)
def test_the_job_says_when_a_preemption_cannot_save(cluster_stand_ins, settings, warned):
    """A cluster whose preemption signals Ray's own processes, or kills at once, is named
    in the job log at start, with what the run then loses and what to ask for."""
    env, state = cluster_stand_ins
    job = _start({**env, "SLURM_JOB_PARTITION": "gpu", **settings})
    _wait_for(state / "train.pid")
    job.send_signal(signal.SIGUSR1)
    err = _finish(job, state)
    notes = [line for line in err.splitlines() if "periodic checkpoint" in line]
    assert len(notes) == len(warned), err
    for note, needle in zip(notes, warned):
        assert needle in note and "checkpoint.save_every" in note
