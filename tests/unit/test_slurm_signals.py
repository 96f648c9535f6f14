"""`train.sbatch` executed, signals included: stand-ins for `srun`, `scontrol`, `ray` and
`dapo-megatron` on PATH run every step of the script on this machine, and the tests
signal it as SLURM does, so the path that must keep Ray up while the trainer saves, and
the requeue that follows, run for real, not only as printed text.

What the stand-ins do is what Slurm 22.05 was seen to do on a real one-node cluster
(tests/slurm; several nodes and separate engine nodes are shown here only):
- the time limit (`--signal=B:USR1@S`): USR1 to the batch shell only, up to ~60 s before
  it is due, so possibly while the job is still starting;
- a preemption with a GraceTime: the job's PreemptTime is set and SIGTERM goes to the
  task of every step, not to the batch shell (which gets SIGTERM only when the grace
  runs out); proctrack/cgroup signals the tasks alone, proctrack/linuxproc every process
  of a step, Ray's too;
- `scontrol requeue` (and `scancel`): the job is COMPLETING; SIGTERM to every step's task
  and to the batch shell; srun can no longer cancel its step, whose processes stay until
  SIGKILL at the end of KillWait (30 s by default);
- srun truncates its --output file unless --open-mode=append, passes USR1 to its task and
  turns a SIGTERM into SIGKILL for its step (while the job runs);
- with pyxis (CONTAINER_IMAGE), enroot runs each step in a container of its own, whose
  /tmp is a fresh tmpfs: here a mount namespace of the step's own (needs root)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "qwen2_5_32b" / "train.sbatch"

# A step: its task runs in a process group of its own (the step's container), output to
# --output (which srun truncates unless --open-mode=append), else to srun's own stdout;
# the task's pid is recorded for the tests to signal as slurmd would, srun's own pid too.
# USR1 is forwarded as-is and TERM as SIGKILL to the whole step, except once the job is
# COMPLETING (requeued or cancelled): SLURM then refuses to cancel the step, whose
# processes stay until KillWait's SIGKILL; every process of the step (its cgroup: those
# that changed process group too, as `ray start` does) carries FAKE_STEP in its
# environment, and the SIGKILL reaches them all. The wait for Ray's devices succeeds at
# once (FAKE_RAY_NEVER_READY: never), unless FAKE_REAL_RAY asks for the real one.
# A step with --container-image runs as pyxis/enroot run it (CONTAINER below).
SRUN = r"""#!/usr/bin/env bash
echo $$ >>"$STATE_DIR/sruns"
out=""
mode=truncate
image=""
while [[ $# -gt 0 && "$1" == -* ]]; do
  case "$1" in
    --output=*) out="${1#--output=}" ;;
    --open-mode=*) mode="${1#--open-mode=}" ;;
    --container-image=*) image="${1#--container-image=}" ;;
    --container-mounts=*) mounts="${1#--container-mounts=}" ;;
    --container-workdir=*) workdir="${1#--container-workdir=}" ;;
    -w) shift ;;
  esac
  shift
done
if [[ "$1" == python3 && "$*" == *cluster_resources* && -z "${FAKE_REAL_RAY:-}" ]]; then
  [[ -z "${FAKE_RAY_NEVER_READY:-}" ]]
  exit
fi
if [[ -n "$image" ]]; then
  set -- unshare -m --propagation private bash -c "$FAKE_CONTAINER" container "$(dirname "$0")" "$mounts" "$workdir" "$@"
fi
step="$STATE_DIR/step-$$"
if [[ -n "$out" ]]; then
  if [[ "$mode" != append ]]; then : >"$out"; fi
  FAKE_STEP="$step" setsid "$@" >>"$out" 2>&1 &
else
  FAKE_STEP="$step" setsid "$@" &
fi
task=$!
echo "$task" >>"$STATE_DIR/steps"
kill_step() {
  kill -KILL -- "-$task"
  local pids
  pids="$(grep -lsxzF "FAKE_STEP=$step" /proc/[0-9]*/environ | cut -d/ -f3)"
  if [[ -n "$pids" ]]; then kill -KILL $pids 2>/dev/null; fi
}
trap 'kill -USR1 "$task"' USR1
trap '[[ -e "$STATE_DIR/completing" ]] || kill_step' TERM
while kill -0 "$task" 2>/dev/null; do wait "$task"; done
wait "$task"
status=$?
# Like slurmstepd, the step ends once every process of it has (its container empty).
group_alive() {
  local stat pid comm state ppid group
  for stat in /proc/[0-9]*/stat; do
    read -r pid comm state ppid group _ <"$stat" 2>/dev/null || continue
    if [[ "$group" == "$1" && "$state" != Z ]]; then return 0; fi
  done
  return 1
}
while group_alive "$task"; do sleep 0.05; done
exit "$status"
"""

# A container of the step's own, as enroot makes one for each step: a private mount
# namespace with a fresh, empty tmpfs on /tmp, in which the --container-mounts folders
# (which must exist, as pyxis wants) are bound back at their paths, and the stand-ins'
# own folders (the image's commands, the tests' state) too; those under /tmp from the
# host's /tmp, kept open as fd 3 (mount --no-canonicalize: the path through /proc/self/fd
# must not be resolved to the /tmp it names, now the tmpfs). Then the task, in the workdir.
CONTAINER = r"""set -e
bin="$1" mounts="$2" workdir="$3"
shift 3
exec 3</tmp
mount -t tmpfs tmpfs /tmp
IFS=, read -r -a folders <<<"$mounts"
for folder in "${folders[@]}" "$bin" "$STATE_DIR"; do
  src="${folder%%:*}" target="${folder#*:}"
  target="${target%%:*}"
  host="$src"
  if [[ "$src" == /tmp/* ]]; then host="/proc/self/fd/3/${src#/tmp/}"; fi
  if [[ ! -d "$host" ]]; then
    echo "pyxis: container start failed: mount source $src: No such file or directory" >&2
    exit 1
  fi
  mkdir -p "$target"
  mount --no-canonicalize --bind "$host" "$target"
done
exec 3<&-
cd "$workdir"
exec "$@"
"""

# Slurm 22.05.8's answers: `show config` lists neither PreemptParameters (a later
# version's, listed for FAKE_SLURM_VERSION) nor cgroup.conf's SignalChildrenProcesses
# (listed when the test gives it).
# `requeue` does what slurmctld and slurmd do (see the module's docstring), KillWait being
# FAKE_KILL_WAIT seconds (30 by default, as SLURM's).
SCONTROL = r"""#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") tr ',' '\n' <<<"$3" ;;
  "show config")
    printf '%s = %s\n' SLURM_VERSION "${FAKE_SLURM_VERSION:-22.05.8}" PreemptType "${FAKE_PREEMPT_TYPE:-preempt/none}" \
      ProctrackType "${FAKE_PROCTRACK:-proctrack/cgroup}" SlurmctldParameters "${FAKE_SLURMCTLD_PARAMETERS:-(null)}"
    if [[ "${FAKE_SLURM_VERSION:-22.05.8}" != 22.* ]]; then
      printf '%s = %s\n' PreemptParameters "${FAKE_PREEMPT_PARAMETERS:-(null)}"
    fi
    if [[ -n "${FAKE_SIGNAL_CHILDREN:-}" ]]; then printf '%s = %s\n' SignalChildrenProcesses "$FAKE_SIGNAL_CHILDREN"; fi ;;
  "show partition") echo "PartitionName=gpu GraceTime=${FAKE_GRACE_TIME:-600} PreemptMode=REQUEUE" ;;
  "show job")
    state=RUNNING
    if [[ -e "$STATE_DIR/completing" ]]; then state=COMPLETING; fi
    preempt=None
    if [[ -e "$STATE_DIR/preempted" ]]; then preempt=2026-01-01T00:01:00; fi
    echo "JobId=$3 JobName=dapo-train"
    echo "   JobState=$state Reason=None Dependency=(null)"
    echo "   RunTime=00:01:00 TimeLimit=${FAKE_TIME_LIMIT:-UNLIMITED} TimeMin=N/A"
    echo "   PreemptEligibleTime=2026-01-01T00:00:00 PreemptTime=$preempt" ;;
  requeue*)
    if [[ -n "${FAKE_REQUEUE_FAILS:-}" ]]; then exit 1; fi
    echo "$*" >>"$STATE_DIR/scontrol.log"
    alive=0
    for pid in $(cat "$STATE_DIR/ray.pids" 2>/dev/null); do
      read -r _ _ state _ <"/proc/$pid/stat" 2>/dev/null || continue
      if [[ "$state" != Z ]]; then alive=$((alive + 1)); fi
    done
    echo "$alive" >"$STATE_DIR/ray_alive_at_requeue"
    touch "$STATE_DIR/completing"
    for task in $(cat "$STATE_DIR/steps" 2>/dev/null); do kill -TERM "$task" 2>/dev/null; done
    kill -TERM "$PPID"
    setsid bash -c 'sleep "$1"; kill -KILL "$2"; shift 2; for t in "$@"; do kill -KILL -- "-$t"; done' \
      killwait "${FAKE_KILL_WAIT:-30}" "$PPID" $(cat "$STATE_DIR/steps" 2>/dev/null) </dev/null >/dev/null 2>&1 &
    echo $! >>"$STATE_DIR/killwait.pids" ;;
esac
"""

# `ray start ... --block`: up until signalled; like Ray, shuts down on SIGTERM.
RAY = r"""#!/usr/bin/env bash
echo $$ >>"$STATE_DIR/ray.pids"
echo "$*" >>"$STATE_DIR/ray.args"
trap 'exit 0' TERM
while true; do sleep 0.1; done
"""

# `dapo-megatron plan` accepts (after FAKE_PLAN_SECONDS); `train` waits for a signal, then
# records which Ray nodes are alive and, as the real trainer does, saves and exits 75 when
# Ray is up, or fails (exit 1, "Failed to connect to GCS") when Ray went first; signalled
# while still starting (FAKE_TRAIN_STARTING) it exits 128 + the signal's number with
# nothing saved; FAKE_TRAIN_EXIT: a failure of its own, with no signal. FAKE_REAL_RAY: it
# joins the real cluster at its ray.address, runs a task there, records the step the task
# ran in and its own, and what its /tmp holds, and exits 0.
TRAINER = r"""#!{python}
import os, signal, sys, time
state = os.environ["STATE_DIR"]
if sys.argv[1] == "plan":
    if os.environ.get("FAKE_PLAN_SECONDS"):
        open(os.path.join(state, "plan.started"), "w").close()
        time.sleep(float(os.environ["FAKE_PLAN_SECONDS"]))
    sys.exit(0)
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
print("train attempt", os.environ.get("SLURM_RESTART_COUNT", "0"), flush=True)
open(os.path.join(state, "train.args"), "w").write(" ".join(sys.argv[1:]))
open(os.path.join(state, "train.pid"), "w").write(str(os.getpid()))
if os.environ.get("FAKE_REAL_RAY"):
    import ray

    address = next(arg for arg in sys.argv if arg.startswith("ray.address="))
    ray.init(address=address.split("=", 1)[1], logging_level="ERROR")
    step = ray.get(ray.remote(num_cpus=1)(lambda: os.environ.get("FAKE_STEP")).remote(), timeout=60)
    open(os.path.join(state, "ray_task"), "w").write(f"{step} {os.environ['FAKE_STEP']}")
    open(os.path.join(state, "train_tmp"), "w").write("\n".join(sorted(os.listdir("/tmp"))))
    ray.shutdown()
    sys.exit(0)
if os.environ.get("FAKE_TRAIN_EXIT"):
    print("dapo-megatron train: error: a member failed", file=sys.stderr)
    sys.exit(int(os.environ["FAKE_TRAIN_EXIT"]))
while not got:
    time.sleep(0.05)
name = signal.Signals(got[0]).name[3:]
if os.environ.get("FAKE_TRAIN_STARTING"):
    open(os.path.join(state, "stopped"), "w").write(f"{name} starting")
    sys.exit(128 + got[0])
time.sleep(0.5)  # the step finishes and the checkpoint is written
alive = []
for pid in open(os.path.join(state, "ray.pids")).read().split():
    try:
        os.kill(int(pid), 0)
        alive.append(pid)
    except ProcessLookupError:
        pass
open(os.path.join(state, "stopped"), "w").write(f"{name} {len(alive)}")
if not alive:
    print("Failed to connect to GCS within 60 seconds", file=sys.stderr)
    sys.exit(1)
sys.exit(75)
"""


@pytest.fixture
def cluster_stand_ins(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    ray_temp = Path(tempfile.mkdtemp(prefix="dapo-test-", dir="/tmp"))
    for name, text in (
        ("srun", SRUN),
        ("scontrol", SCONTROL),
        ("ray", RAY),
        ("dapo-megatron", TRAINER.replace("{python}", sys.executable)),
        # The steps' python3 (the script reads the recipe with it): this environment's.
        ("python3", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n'),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STATE_DIR": str(state),
        # 2 nodes of the actor (tp 8 x pp 2 x dp 1) and 1 of separate engines: Ray on all 3.
        "SLURM_JOB_NODELIST": "gpu-007,gpu-008,gpu-009",
        "SLURM_NNODES": "3",
        "ENGINE_NODES": "1",
        "SLURM_JOB_ID": "99",
        "MODEL_DIR": str(tmp_path / "model"),
        "DATA_DIR": str(tmp_path / "data"),
        "OUTPUT_DIR": str(tmp_path / "run"),
        # Where Ray's temp dir goes on the "nodes" (all this machine): short, as Ray's sockets need.
        "RAY_TEMP_ROOT": str(ray_temp),
        "FAKE_CONTAINER": CONTAINER,
    }
    yield env, state
    # What KillWait's SIGKILL would end: anything a test left running.
    for name in ("killwait.pids", "sruns", "ray.pids", "train.pid"):
        for pid in _pids(state / name) if (state / name).exists() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for task in _pids(state / "steps") if (state / "steps").exists() else []:
        try:
            os.killpg(task, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in _processes_of(state):  # the rest of the job's (a real Ray's daemons and workers)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(ray_temp, ignore_errors=True)


def _processes_of(state: Path) -> list[int]:
    """The live processes the test's job started: those with its STATE_DIR in their environment."""
    mark = f"STATE_DIR={state}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0") and _alive(int(environ.parent.name)):
                pids.append(int(environ.parent.name))
        except (OSError, IndexError):
            pass
    return pids


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


def _preempt(state: Path, every_process: bool = False) -> None:
    """What Slurm does at a preemption with a GraceTime: the job's PreemptTime is set, and
    SIGTERM goes to the task of every step still running, not to the batch shell. Under
    proctrack/cgroup (22.05: a step's tasks only) the task alone; ``every_process``: every
    process of the step, as proctrack/linuxproc does (Ray's own processes included)."""
    (state / "preempted").touch()
    for task in _pids(state / "steps"):
        if _alive(task):
            if every_process:
                os.killpg(task, signal.SIGTERM)
            else:
                os.kill(task, signal.SIGTERM)


def _finish(
    job, state: Path, left_behind: tuple[Path, ...] = (), stopped: str = "USR1 3", requeued: bool = True
) -> str:
    """The job's stderr once it has ended: it saved with all 3 Ray nodes up (``stopped``),
    stopped Ray before it asked for the requeue (after it, SLURM no longer cancels the
    steps and Ray would stay until KillWait), and removed its token file
    (``left_behind``: earlier attempts' files)."""
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert (state / "stopped").read_text() == stopped
    if requeued:
        assert (state / "scontrol.log").read_text().split() == ["requeue", "99"], err
        assert (state / "ray_alive_at_requeue").read_text().strip() == "0", f"Ray still up at the requeue: {err}"
    deadline = time.monotonic() + 10  # SIGKILLed processes linger until reaped
    while any(_alive(pid) for pid in _pids(state / "ray.pids")):
        assert time.monotonic() < deadline, "Ray left running"
        time.sleep(0.05)
    assert set((state.parent / "run").glob(".ray_auth_token_*")) == set(left_behind)  # the job's token removed
    return err


def test_the_time_limit_signal_saves_while_ray_is_up_then_requeues(cluster_stand_ins):
    """USR1 to the batch shell only (`--signal=B:USR1@1800`): the trainer gets it and saves
    while all 3 `ray start` steps are up; then Ray is stopped and the job requeued, and it
    ends within seconds (not after KillWait's 30 s of COMPLETING)."""
    env, state = cluster_stand_ins
    job = _start(env)
    _wait_for(state / "train.pid")
    assert len(_pids(state / "ray.pids")) == 3
    signalled = time.monotonic()
    job.send_signal(signal.SIGUSR1)
    err = _finish(job, state)
    assert time.monotonic() - signalled < 15, err
    assert "requeueing job 99" in err


def test_a_preemption_sigterm_to_every_step_leaves_ray_up_until_the_trainer_has_saved(cluster_stand_ins):
    """SIGTERM to every step's task: the trainer's saves; each `ray start` is the child of
    a task that ignores it, so every Ray node is up at the save (a `ray start` run as the
    task itself shuts down at once: the negative control, whose trainer then fails)."""
    env, state = cluster_stand_ins
    job = _start(env)
    _wait_for(state / "train.pid")
    _preempt(state)
    _finish(job, state, stopped="TERM 3")

    copy = Path(env["STATE_DIR"]).parent / "unshielded" / "examples" / "qwen2_5_32b"
    copy.mkdir(parents=True)
    for path in SCRIPT.parent.iterdir():  # the script reads its recipe (and the model's config.json)
        if path.is_file():
            (copy / path.name).write_text(path.read_text())
    unshielded = copy / "train.sbatch"
    unshielded.write_text(SCRIPT.read_text().replace('"${RAY_STEP[@]}" ray start', "ray start"))
    for name in ("stopped", "train.pid", "steps", "ray.pids", "scontrol.log", "preempted"):
        (state / name).unlink(missing_ok=True)
    job = _start(env, unshielded)
    _wait_for(state / "train.pid")
    _preempt(state)
    job.communicate(timeout=60)
    assert (state / "stopped").read_text() == "TERM 0"


def test_when_a_preemption_kills_ray_first_the_job_still_requeues(cluster_stand_ins):
    """proctrack/linuxproc (or wherever Ray goes first): the preemption's SIGTERM reaches
    every process of every step; Ray exits, the trainer cannot save and fails (exit 1, as
    the real one does), and the batch shell got no signal. The job is being preempted
    (PreemptTime set), so it is requeued all the same: it resumes from its last checkpoint."""
    env, state = cluster_stand_ins
    job = _start(env)
    _wait_for(state / "train.pid")
    _preempt(state, every_process=True)
    err = _finish(job, state, stopped="TERM 0")
    assert "preempt" in err and "requeueing job 99" in err


def test_a_failure_of_the_trainer_is_not_requeued(cluster_stand_ins):
    """No stop was asked for (no signal, no preemption): the trainer's own failure ends
    the job with its status, and is not retried in a loop."""
    env, state = cluster_stand_ins
    job = _start({**env, "FAKE_TRAIN_EXIT": "1"})
    _, err = job.communicate(timeout=60)
    assert job.returncode == 1, err
    assert not (state / "scontrol.log").exists() and "requeue" not in err
    assert not any(_alive(pid) for pid in _pids(state / "ray.pids"))


def test_a_sigterm_to_the_batch_shell_reaches_the_trainer_as_usr1(cluster_stand_ins):
    """srun turns a forwarded SIGTERM into SIGKILL: the script forwards USR1 instead."""
    env, state = cluster_stand_ins
    job = _start(env)
    _wait_for(state / "train.pid")
    job.send_signal(signal.SIGTERM)
    _finish(job, state)


def test_a_requeue_that_fails_still_ends_the_saved_run_cleanly(cluster_stand_ins):
    """Preemption with PreemptMode=REQUEUE requeues the job itself; `scontrol requeue`
    may then fail: the checkpoint is written, so the script says so and exits 0."""
    env, state = cluster_stand_ins
    job = _start({**env, "FAKE_REQUEUE_FAILS": "1"})
    _wait_for(state / "train.pid")
    _preempt(state)
    err = _finish(job, state, stopped="TERM 3", requeued=False)
    assert "could not requeue job 99" in err and "--resume" in err


def _forget_the_job(state: Path) -> None:
    for name in ("stopped", "train.pid", "steps", "ray.pids", "scontrol.log", "completing", "ray_alive_at_requeue"):
        (state / name).unlink(missing_ok=True)


def test_a_usr1_during_start_up_requeues_before_the_trainer_runs(cluster_stand_ins):
    """SLURM's USR1 may come ~30-60 s before it is due, so while the job still starts
    (here: during the placement rehearsal, before Ray): the script stops at once, nothing
    is lost (nothing was trained), and the job is requeued."""
    env, state = cluster_stand_ins
    job = _start({**env, "FAKE_PLAN_SECONDS": "30"})
    _wait_for(state / "plan.started")
    signalled = time.monotonic()
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert time.monotonic() - signalled < 10, err
    assert (state / "scontrol.log").read_text().split() == ["requeue", "99"], err
    assert not (state / "train.pid").exists() and not (state / "ray.pids").exists()
    assert "start" in err


def test_a_usr1_while_ray_starts_stops_ray_and_requeues(cluster_stand_ins):
    """USR1 while the script waits for Ray's nodes: Ray is stopped, then the job requeued."""
    env, state = cluster_stand_ins
    job = _start({**env, "FAKE_RAY_NEVER_READY": "1"})
    deadline = time.monotonic() + 30
    while not (state / "ray.pids").exists() or len(_pids(state / "ray.pids")) < 3:
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert (state / "scontrol.log").read_text().split() == ["requeue", "99"], err
    assert (state / "ray_alive_at_requeue").read_text().strip() == "0", err
    assert not (state / "train.pid").exists()
    assert not list((state.parent / "run").glob(".ray_auth_token_*"))


def test_a_usr1_while_the_trainer_starts_requeues(cluster_stand_ins):
    """The trainer signalled while still starting exits 128 + 10 with nothing to save
    (cli.py): the job is requeued and the next attempt starts where this one began."""
    env, state = cluster_stand_ins
    job = _start({**env, "FAKE_TRAIN_STARTING": "1"})
    _wait_for(state / "train.pid")
    job.send_signal(signal.SIGUSR1)
    err = _finish(job, state, stopped="USR1 starting")
    assert "requeueing job 99" in err


def test_a_cancelled_job_is_not_requeued_and_ends_before_killwait(cluster_stand_ins):
    """`scancel`: SIGTERM to every step's task and to the batch shell, the job COMPLETING
    (srun can no longer cancel its step). The trainer saves; the script does not requeue a
    job that is ending, removes its token, and does not wait for the Ray steps beyond
    RAY_STOP_SECONDS (they end at KillWait's SIGKILL)."""
    env, state = cluster_stand_ins
    job = _start({**env, "RAY_STOP_SECONDS": "2"})
    _wait_for(state / "train.pid")
    (state / "completing").touch()
    for task in _pids(state / "steps"):
        if _alive(task):
            os.kill(task, signal.SIGTERM)
    cancelled = time.monotonic()
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    assert time.monotonic() - cancelled < 10, err
    assert (state / "stopped").read_text() == "TERM 3"
    assert not (state / "scontrol.log").exists(), err
    assert "not requeued" in err
    assert not list((state.parent / "run").glob(".ray_auth_token_*"))
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in _pids(state / "sruns")):  # the script's own srun clients
        assert time.monotonic() < deadline, "srun left running"
        time.sleep(0.05)


def test_a_time_limit_shorter_than_the_signal_lead_ignores_usr1(cluster_stand_ins):
    """--time=10 with the header's --signal=B:USR1@1800: SLURM sends USR1 as the job
    starts, in every attempt; requeueing on it would loop for ever. The script says so at
    start and ignores USR1 (the run ends at its time limit, or before)."""
    env, state = cluster_stand_ins
    job = _start({**env, "FAKE_TIME_LIMIT": "00:10:00"})
    _wait_for(state / "train.pid")
    job.send_signal(signal.SIGUSR1)
    time.sleep(1.5)
    assert not (state / "stopped").exists() and job.poll() is None
    job.send_signal(signal.SIGTERM)  # a stop that is not the time limit's still saves and requeues
    err = _finish(job, state)
    note = next(line for line in err.splitlines() if "ignores USR1" in line)
    assert "SIGNAL_LEAD_S=1800" in note and "00:10:00" in note


def test_without_dapo_megatron_on_the_path_the_job_says_what_is_missing(cluster_stand_ins):
    """Not "the layout does not fit": the check runs first, on the head node, and names
    the command and the ways to provide it."""
    env, state = cluster_stand_ins
    bin_dir = Path(env["PATH"].split(":", 1)[0])
    (bin_dir / "dapo-megatron").unlink()
    job = _start({**env, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    _, err = job.communicate(timeout=60)
    assert job.returncode == 2, err
    assert "dapo-megatron" in err and "not on PATH" in err and "CONTAINER_IMAGE" in err and "virtualenv" in err
    assert "does not fit" not in err
    assert not (state / "ray.pids").exists()


def test_a_cpu_recipe_keeps_its_layout_and_declares_its_cpus_to_ray(cluster_stand_ins):
    """The demo recipe on one CPU node (`sbatch --gpus-per-node=0`): no GPU settings
    forced on it, its own model and data, Ray declaring CPUs for 2 ranks + 1 engine + the
    driver, the wait on CPUs; the time limit still saves and requeues."""
    env, state = cluster_stand_ins
    env = {k: v for k, v in env.items() if k not in ("MODEL_DIR", "DATA_DIR", "ENGINE_NODES")}
    env.update(
        RECIPE="examples/demo/demo.yaml",
        SLURM_JOB_NODELIST="cpu-001",
        SLURM_NNODES="1",
        SLURM_GPUS_PER_NODE="0",
        SLURM_CPUS_ON_NODE="2",
    )
    job = _start(env)
    _wait_for(state / "train.pid")
    args = (state / "train.args").read_text().split()
    assert args[:2] == ["train", "examples/demo/demo.yaml"]
    assert not any(a.startswith(("model.", "data.", "checkpoint.load_dir", "rollout.num_engines")) for a in args), args
    assert not any(a.startswith(("parallel.num_devices_per_node", "rollout.engine_tp_size")) for a in args), args
    assert "parallel.num_nodes=1" in args and "ray.address=cpu-001:6379" in args
    ray_args = (state / "ray.args").read_text()
    assert "--num-cpus=4" in ray_args and "--num-gpus=0" in ray_args, ray_args
    job.send_signal(signal.SIGUSR1)
    _finish(job, state, stopped="USR1 1")


@pytest.mark.parametrize(
    "settings, said, warned",
    [
        # Slurm 22.05 (no SignalChildrenProcesses, no PreemptParameters), proctrack/cgroup.
        ({"FAKE_PREEMPT_TYPE": "preempt/partition_prio"}, "step's tasks only", ()),
        (
            {"FAKE_PREEMPT_TYPE": "preempt/partition_prio", "FAKE_PROCTRACK": "proctrack/linuxproc"},
            "proctrack/linuxproc",
            ("every process of a step", "SlurmctldParameters=preempt_send_user_signal"),
        ),
        (
            {
                "FAKE_PREEMPT_TYPE": "preempt/partition_prio",
                "FAKE_PROCTRACK": "proctrack/linuxproc",
                "FAKE_SLURMCTLD_PARAMETERS": "preempt_send_user_signal",
            },
            "USR1",
            (),
        ),
        # A later version: the cgroup.conf setting exists, and PreemptParameters.
        (
            {"FAKE_SLURM_VERSION": "24.05.4", "FAKE_PREEMPT_TYPE": "preempt/qos", "FAKE_SIGNAL_CHILDREN": "yes"},
            "SignalChildrenProcesses=yes",
            ("SignalChildrenProcesses=yes", "PreemptParameters=send_user_signal"),
        ),
        (
            {"FAKE_SLURM_VERSION": "24.05.4", "FAKE_PREEMPT_TYPE": "preempt/qos", "FAKE_SIGNAL_CHILDREN": "no"},
            "SignalChildrenProcesses=no",
            (),
        ),
        (
            {
                "FAKE_SLURM_VERSION": "24.05.4",
                "FAKE_PREEMPT_TYPE": "preempt/qos",
                "FAKE_SIGNAL_CHILDREN": "yes",
                "FAKE_PREEMPT_PARAMETERS": "send_user_signal,min_exempt_priority=5",
            },
            "USR1",
            (),
        ),
        (
            {"FAKE_PREEMPT_TYPE": "preempt/partition_prio", "FAKE_GRACE_TIME": "0"},
            "step's tasks only",
            ("GraceTime=0",),
        ),
        ({"FAKE_PREEMPT_TYPE": "preempt/none", "FAKE_SIGNAL_CHILDREN": "yes", "FAKE_GRACE_TIME": "0"}, None, ()),
    ],
)
def test_the_job_says_how_a_preemption_ends_it(cluster_stand_ins, settings, said, warned):
    """At start the job log says what this cluster's version and settings do at a
    preemption (no `?` for a setting the version lacks); where a preemption cannot save,
    or kills at once, a warning says what the run then loses and what to ask for."""
    env, state = cluster_stand_ins
    job = _start({**env, "SLURM_JOB_PARTITION": "gpu", **settings})
    _wait_for(state / "train.pid")
    job.send_signal(signal.SIGUSR1)
    err = _finish(job, state)
    lines = [
        line
        for line in err.splitlines()
        if line.startswith("train.sbatch:") and "preempt" in line.lower() and "requeueing" not in line
    ]
    if said is None:
        assert not lines, err
        return
    assert lines and all("?" not in line for line in lines), err
    assert said in lines[0] and "Slurm " + settings.get("FAKE_SLURM_VERSION", "22.05.8") in lines[0], lines
    notes = [line for line in err.splitlines() if "periodic checkpoint" in line]
    assert len(notes) == (1 if warned else 0), err
    for needle in warned:
        assert any(needle in note for note in notes), (needle, notes)
    for note in notes:
        assert "checkpoint.save_every" in note


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


def test_the_job_refuses_a_ray_temp_dir_that_is_not_its_own(cluster_stand_ins):
    """Anything already at the path of the attempt's Ray temp dir on a node (someone
    else's) was not made by this attempt: the job stops before Ray starts, says what to
    do, and leaves it as it is (the removal at exit touches only what has the attempt's mark)."""
    env, state = cluster_stand_ins
    temp = Path(env["RAY_TEMP_ROOT"]) / "dapo-ray-99-0"
    temp.mkdir()
    (temp / "theirs").write_text("theirs\n")
    err = _refused(env, state)
    assert f"temp dir {temp} " in err and "remove it" in err, err
    assert [path.name for path in temp.iterdir()] == ["theirs"]


def test_the_job_refuses_a_ray_temp_dir_too_long_for_rays_sockets(cluster_stand_ins):
    env, state = cluster_stand_ins
    err = _refused({**env, "RAY_TEMP_ROOT": "/tmp/" + "x" * 25}, state)  # + /dapo-ray-99-0: 44 bytes
    assert "44 bytes" in err and "at most 43" in err, err


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


def test_steps_in_containers_each_with_its_own_tmp_reach_the_real_ray(cluster_stand_ins):
    """pyxis/enroot gives every step a container of its own, with a fresh tmpfs on /tmp,
    where Ray keeps its sockets by default: here each step with --container-image runs
    so too (CONTAINER). The real `ray start` (this environment's Ray), the real wait for
    the cluster's CPUs and a trainer that joins the cluster and runs a task there all
    reach the raylet through Ray's temp dir (by default under /tmp), a host folder the
    job makes before Ray starts, mounts into each step and removes at its end."""
    if subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode:
        pytest.skip("needs a mount namespace of its own (unshare -m: root)")
    env, state = cluster_stand_ins
    bin_dir = Path(env["PATH"].split(":", 1)[0])
    real_ray = Path(sys.executable).with_name("ray")
    (bin_dir / "ray").write_text(
        f'#!/bin/sh\necho $$ >>"$STATE_DIR/ray.pids"\necho "$*" >>"$STATE_DIR/ray.args"\nexec "{real_ray}" "$@"\n'
    )
    with socket.socket() as probe:  # a free port for the head (another Ray may run here)
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    job_id = str(os.getpid())
    temp = Path(f"/tmp/dapo-ray-{job_id}-0")  # the default: one per job and attempt
    assert not temp.exists()
    env = {k: v for k, v in env.items() if k not in ("MODEL_DIR", "DATA_DIR", "ENGINE_NODES", "RAY_TEMP_ROOT")}
    env.update(
        RECIPE="examples/demo/demo.yaml",
        # A head and a worker, both on this machine.
        SLURM_JOB_NODELIST=f"{socket.gethostname()},{socket.gethostname()}",
        SLURM_NNODES="2",
        SLURM_GPUS_PER_NODE="0",
        SLURM_CPUS_ON_NODE="2",
        SLURM_JOB_ID=job_id,
        CONTAINER_IMAGE="/images/dapo-megatron.sqsh",
        FAKE_REAL_RAY="1",
        RAY_PORT=str(port),
        RAY_WAIT_SECONDS="40",
        RAY_USAGE_STATS_ENABLED="0",
    )
    job = _start(env)
    try:
        _, err = job.communicate(timeout=150)
        logs = Path(env["OUTPUT_DIR"]) / "logs" / job_id / "attempt-0"
        said = "".join(f"\n--- {path.name}:\n{path.read_text()[-3000:]}" for path in sorted(logs.glob("*.log")))
        assert job.returncode == 0, err + said
        # The trainer's step saw a /tmp of its own: only the folders mounted into it.
        mounted = {
            temp,
            state,
            bin_dir,
            Path(env["OUTPUT_DIR"]),
            ROOT,
        }  # (ROOT: the repository, under /tmp in a clone there)
        seen = {path.relative_to("/tmp").parts[0] for path in mounted if path.is_relative_to("/tmp")}
        assert set((state / "train_tmp").read_text().split()) == seen
        # The task ran in a Ray worker of a `ray start` step (not in the trainer's step), and
        # both `ray start` (head, worker) kept their files in the job's folder.
        task_step, train_step = (state / "ray_task").read_text().split()
        assert task_step.startswith(str(state / "step-")) and task_step != train_step
        starts = (state / "ray.args").read_text().splitlines()
        assert len(starts) == 2 and all(f"--temp-dir={temp} " in start for start in starts), starts
        assert not temp.exists(), "the job's Ray temp dir was left behind"
        deadline = time.monotonic() + 10
        while _processes_of(state):
            assert time.monotonic() < deadline, "Ray left running"
            time.sleep(0.1)
    finally:
        if job.poll() is None:
            job.kill()
        if (temp / f".made-by-job-{job_id}-attempt-0").exists():
            shutil.rmtree(temp)
