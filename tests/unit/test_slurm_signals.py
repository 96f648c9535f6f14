"""`train.sbatch` executed, signals included: stand-ins for `srun`, `scontrol`, `ray` and
`dapo-megatron` on PATH run every step of the script on this machine, and the tests
signal it as SLURM does (at the time limit: USR1 to the batch shell only; at preemption:
SIGTERM to the task of every step), so the path that must keep Ray up while the trainer
saves runs for real, not only as printed text."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "qwen2_5_32b" / "train.sbatch"

# A step: its task runs in a process group of its own (the step's container), output to
# --output, which srun truncates unless --open-mode=append; the task's pid is recorded for
# the tests to signal as slurmd would. As srun does, USR1 is forwarded as-is and TERM as
# SIGKILL to the whole step. The Ray GPU wait succeeds at once.
SRUN = r"""#!/usr/bin/env bash
out=/dev/null
mode=truncate
while [[ $# -gt 0 && "$1" == -* ]]; do
  case "$1" in
    --output=*) out="${1#--output=}" ;;
    --open-mode=*) mode="${1#--open-mode=}" ;;
    -w) shift ;;
  esac
  shift
done
if [[ "$1" == python3 && "$*" == *cluster_resources* ]]; then exit 0; fi
if [[ "$mode" != append ]]; then : >"$out"; fi
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
print("train attempt", os.environ.get("SLURM_RESTART_COUNT", "0"), flush=True)
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


def _finish(job, state: Path, left_behind: tuple[Path, ...] = ()) -> str:
    """The job's stderr once it has ended; checks it saved with all 3 Ray nodes up, then
    stopped Ray and removed its token file (``left_behind``: earlier attempts' files)."""
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    saved = (state / "saved").read_text()
    assert saved.endswith(" 3"), f"Ray nodes alive when the trainer saved: {saved}"
    deadline = time.monotonic() + 10  # SIGKILLed processes linger until reaped
    while any(_alive(pid) for pid in _pids(state / "ray.pids")):
        assert time.monotonic() < deadline, "Ray left running"
        time.sleep(0.05)
    assert set((state.parent / "run").glob(".ray_auth_token_*")) == set(left_behind)  # the job's token removed
    return err


def test_the_time_limit_signal_saves_while_ray_is_up_then_requeues(cluster_stand_ins):
    """USR1 to the batch shell only (`--signal=B:USR1@1800`): the trainer gets it and saves
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


def _forget_the_job(state: Path) -> None:
    for name in ("saved", "train.pid", "steps", "ray.pids"):
        (state / name).unlink(missing_ok=True)


def test_a_requeued_job_keeps_the_logs_of_every_attempt(cluster_stand_ins):
    """A requeued job keeps its job id (SLURM_RESTART_COUNT counts the attempts) and srun
    truncates its --output files: the second attempt must not overwrite the first's logs.
    The first attempt is then killed outright, leaving its token file: the next one starts."""
    env, state = cluster_stand_ins
    killed = _token_path(env)
    for attempt in ("0", "1"):
        _forget_the_job(state)
        job = _start({**env, "SLURM_RESTART_COUNT": attempt})
        _wait_for(state / "train.pid")
        job.send_signal(signal.SIGUSR1)
        _finish(job, state, left_behind=(killed,) if attempt == "1" else ())
        if attempt == "0":
            killed.write_text("a killed attempt's token\n")
            killed.chmod(0o600)
    logs = state.parent / "run" / "logs" / "99"
    train_logs = {str(path.relative_to(logs)): path.read_text() for path in sorted(logs.rglob("train*.log"))}
    for attempt in ("0", "1"):
        assert any(f"train attempt {attempt}\n" in text for text in train_logs.values()), train_logs
    plan_logs = list(logs.rglob("plan*.log"))
    assert len(plan_logs) == 2, plan_logs
    assert sorted(train_logs) == ["attempt-0/train.log", "attempt-1/train.log"], train_logs


def _token_path(env: dict) -> Path:
    """The job's token file: one per attempt (a killed attempt's is left behind)."""
    return Path(env["OUTPUT_DIR"]) / f".ray_auth_token_{env['SLURM_JOB_ID']}_{env.get('SLURM_RESTART_COUNT', '0')}"


def _refused(env: dict, state: Path) -> str:
    """Runs the job, which must stop before starting Ray; its stderr."""
    job = _start(env)
    deadline = time.monotonic() + 60
    while job.poll() is None and not (state / "train.pid").exists():
        assert time.monotonic() < deadline, "the job neither stopped nor started the trainer"
        time.sleep(0.05)
    if job.poll() is None:  # not refused: end the job before failing
        job.send_signal(signal.SIGUSR1)
        _, err = job.communicate(timeout=60)
        pytest.fail(f"the job started Ray and the trainer instead of refusing: {err}")
    _, err = job.communicate(timeout=60)
    assert job.returncode != 0, err
    assert not (state / "ray.pids").exists()  # nothing started on the nodes
    return err


def test_the_job_refuses_a_token_file_that_already_exists(cluster_stand_ins):
    """Someone else's file at the token's name (readable by all): the job neither writes
    its secret into it nor removes it, and says which path and what to do."""
    env, state = cluster_stand_ins
    token = _token_path(env)
    token.parent.mkdir(parents=True)
    token.write_text("planted\n")
    token.chmod(0o644)
    err = _refused(env, state)
    assert str(token) in err and "remove" in err, err
    assert token.read_text() == "planted\n" and stat.S_IMODE(token.stat().st_mode) == 0o644


def test_the_job_refuses_a_symlink_at_the_token_name(cluster_stand_ins, tmp_path):
    """A link planted at the token's name, to a file or to nothing: the secret is not
    written through it, and the file it points at is untouched."""
    env, state = cluster_stand_ins
    token = _token_path(env)
    token.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("victim\n")
    victim.chmod(0o644)
    for target in (victim, tmp_path / "nowhere"):
        token.unlink(missing_ok=True)
        token.symlink_to(target)
        err = _refused(env, state)
        assert str(token) in err, err
        assert token.is_symlink() and not (tmp_path / "nowhere").exists()
        assert victim.read_text() == "victim\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644


def test_the_token_file_is_private_while_the_job_runs(cluster_stand_ins):
    env, state = cluster_stand_ins
    job = _start(env)
    _wait_for(state / "train.pid")
    tokens = list(Path(env["OUTPUT_DIR"]).glob(".ray_auth_token_*"))
    assert tokens == [_token_path(env)]
    info = tokens[0].lstat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    assert re.fullmatch(r"[0-9a-f]{64}\n?", tokens[0].read_text())
    job.send_signal(signal.SIGUSR1)
    _finish(job, state)
