"""A real one-node SLURM on this machine for the tests of this tier: Debian's `slurm-wlm`
and `munge` (installed with apt when missing and the tests run as root; otherwise the tier
is skipped, the reason printed), a config written for this host into a temporary folder,
and `munged`, `slurmctld` and `slurmd` started for the session and stopped by pid at its end.

The config (``SlurmConfig``): the node as `slurmd -C` reports it; `proctrack/cgroup` with
`task/cgroup` where cgroup v1 is mounted (its freezer hierarchy), else `proctrack/linuxproc`;
`select/cons_tres`; one partition `main`; settings that shorten the job cycle:
`AuthInfo=cred_expire=5` (a requeued job may start again after 5 s instead of 120),
`SchedulerParameters=sched_interval=1`, `KillWait=5`, `FirstJobId` from the clock (job ids of its own,
not those of an earlier session), and `MinJobAge=600` so that finished
jobs stay visible to `scontrol show job` (there is no slurmdbd, hence no `sacct`).

A test gets the cluster through the ``slurm`` fixture; ``@pytest.mark.slurm_config(...)``
(the keyword arguments of ``SlurmConfig``) asks for another config, e.g. two partitions of
different ``PriorityTier`` with preemption, or `proctrack/linuxproc`: the daemons are then
restarted with it (a few seconds), and again with the default for a test without the mark.
Clients get the cluster through ``SlurmCluster.env`` (``SLURM_CONF``); nothing is written
to ``os.environ``, so the other tiers never see it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil
import pytest

PACKAGES = ("slurm-wlm", "munge")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun", "scancel")
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
    }
)
# One real SLURM per machine at a time: two sessions' slurmd would share the cgroup
# hierarchy slurm_<node> and their job ids.
LOCK_FILE = Path(tempfile.gettempdir()) / "dapo-megatron-slurm-tier.lock"
LOCK_WAIT_S = 600
START_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Partition:
    name: str
    priority_tier: int = 1
    default: bool = False
    preempt_mode: Optional[str] = None  # e.g. "REQUEUE", "OFF"
    grace_time: Optional[int] = None  # seconds
    max_time: str = "INFINITE"

    def line(self, node: str) -> str:
        words = [
            f"PartitionName={self.name}",
            f"Nodes={node}",
            f"Default={'YES' if self.default else 'NO'}",
            f"PriorityTier={self.priority_tier}",
            f"MaxTime={self.max_time}",
            "State=UP",
        ]
        if self.preempt_mode is not None:
            words.append(f"PreemptMode={self.preempt_mode}")
        if self.grace_time is not None:
            words.append(f"GraceTime={self.grace_time}")
        return " ".join(words)


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    """What may differ between tests; ``extra`` adds or replaces slurm.conf lines
    (``(("PreemptParameters", "send_user_signal"),)``)."""

    proctrack: str = "auto"  # "auto" (cgroup where cgroup v1 is mounted, else linuxproc), "cgroup", "linuxproc"
    partitions: tuple[Partition, ...] = (Partition("main", default=True),)
    preempt_type: str = "preempt/none"
    preempt_mode: str = "OFF"
    kill_wait: int = 5
    min_job_age: int = 600
    cred_expire: int = 5
    sched_interval: int = 1
    extra: tuple[tuple[str, str], ...] = ()


def cgroup_v1_mounted() -> bool:
    """Whether a cgroup v1 freezer hierarchy is mounted (what Slurm 22.05's cgroup/v1 needs)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(len(m.split()) > 3 and m.split()[2] == "cgroup" and "freezer" in m.split()[3].split(",") for m in mounts)


def _missing_programs() -> list[str]:
    # The daemons live in /usr/sbin, which a user's PATH may lack.
    return [p for p in PROGRAMS if not shutil.which(p, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")]


def _install() -> Optional[str]:
    """Installs slurm-wlm and munge when missing; returns why the tier cannot run, or None."""
    missing = _missing_programs()
    if not missing:
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return (
            f"no SLURM here ({', '.join(missing)} missing) and the tests cannot install it (needs root and apt-get): "
            f"apt-get install {' '.join(PACKAGES)} to run this tier"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:  # a fresh machine's package lists may be empty or old
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=900)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        return f"`{' '.join(install)}` failed (exit {result.returncode}): {(result.stdout + result.stderr)[-1500:]}"
    missing = _missing_programs()
    return f"installed {' '.join(PACKAGES)} but {', '.join(missing)} still missing" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"({exc})"
    return "\n".join(text[-lines:])


def parse_fields(line: str) -> dict[str, str]:
    """``scontrol show ... -o`` output as a dict (the first occurrence of a key wins: a value
    such as Command='s.sh a=1' may hold ' key=' itself)."""
    fields: dict[str, str] = {}
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][\w:/]*)=", line))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        fields.setdefault(match.group(1), line[match.end() : end].strip())
    return fields


class SlurmCluster:
    """The running one-node cluster: its config, its daemons, and client helpers."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "etc" / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.host = socket.gethostname().split(".")[0]
        self.config: Optional[SlurmConfig] = None
        self.proctrack = ""
        self._ports = (_free_port(), _free_port())
        self._daemons: dict[str, subprocess.Popen] = {}
        # Job ids of their own: a fresh slurmctld would number from 1 again, and a job's
        # files outside this folder (train.sbatch's Ray temp dir, /tmp/dapo-ray-<job>-<n>,
        # left by a job that ended by scancel or a preemption) would meet a later
        # session's job of the same id. Seconds since the epoch, under SLURM's MaxJobId.
        self.first_job_id = 1000 + int(time.time()) % 60_000_000
        node = subprocess.run([self._program("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
        line = next(line for line in node.splitlines() if line.startswith("NodeName="))
        # This host's name, reached over loopback.
        self.node_line = re.sub(r"^NodeName=\S+", f"NodeName={self.host} NodeAddr=127.0.0.1", line)
        for sub in ("etc", "state", "spool", "log", "run", "munge"):
            (root / sub).mkdir(mode=0o755)
        # SLURM_* of an enclosing job (a suite run inside SLURM) must not reach our clients.
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        self.env = {
            **base,
            "SLURM_CONF": str(self.conf),
            # The clients and the jobs (--export=ALL) find the daemons' programs and this venv's.
            "PATH": f"{Path(sys.executable).parent}:{base.get('PATH', '')}:/usr/sbin:/sbin",
        }

    def _program(self, name: str) -> str:
        return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin") or name

    # ---- config -------------------------------------------------------------------------
    def _resolve_proctrack(self, config: SlurmConfig) -> str:
        if config.proctrack == "auto":
            return "cgroup" if cgroup_v1_mounted() else "linuxproc"
        if config.proctrack == "cgroup" and not cgroup_v1_mounted():
            pytest.skip("proctrack/cgroup asked for, but no cgroup v1 (freezer) hierarchy is mounted here")
        return config.proctrack

    def write_config(self, config: SlurmConfig) -> None:
        proctrack = self._resolve_proctrack(config)
        root = self.root
        settings = {
            "ClusterName": "dapotest",
            "SlurmctldHost": f"{self.host}(127.0.0.1)",
            "SlurmctldPort": str(self._ports[0]),
            "SlurmdPort": str(self._ports[1]),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.munge_socket},cred_expire={config.cred_expire}",
            "StateSaveLocation": str(root / "state"),
            "SlurmdSpoolDir": str(root / "spool"),
            "SlurmctldLogFile": str(root / "log" / "slurmctld.log"),
            "SlurmdLogFile": str(root / "log" / "slurmd.log"),
            "SlurmctldPidFile": str(root / "run" / "slurmctld.pid"),
            "SlurmdPidFile": str(root / "run" / "slurmd.pid"),
            "ProctrackType": f"proctrack/{proctrack}",
            "TaskPlugin": "task/cgroup" if proctrack == "cgroup" else "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "SchedulerType": "sched/backfill",
            "SchedulerParameters": f"sched_interval={config.sched_interval}",
            "PreemptType": config.preempt_type,
            "PreemptMode": config.preempt_mode,
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "MpiDefault": "none",
            "MailProg": "/bin/true",
            "ReturnToService": "2",
            "KillWait": str(config.kill_wait),
            "MinJobAge": str(config.min_job_age),
            "FirstJobId": str(self.first_job_id),
            "InactiveLimit": "0",
            "SlurmctldDebug": "info",
            "SlurmdDebug": "info",
        }
        settings.update(dict(config.extra))
        lines = [f"{key}={value}" for key, value in settings.items()]
        lines.append(self.node_line)
        lines += [partition.line(self.host) for partition in config.partitions]
        (root / "etc" / "slurm.conf").write_text("\n".join(lines) + "\n")
        cgroup = ["CgroupPlugin=cgroup/v1", "CgroupMountpoint=/sys/fs/cgroup"] if proctrack == "cgroup" else []
        (root / "etc" / "cgroup.conf").write_text("".join(f"{line}\n" for line in cgroup))
        self.config, self.proctrack = config, proctrack

    # ---- daemons ------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        with log:
            self._daemons[name] = subprocess.Popen(
                [self._program(name), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # a Ctrl-C of pytest reaches it through our teardown only
            )

    def start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge = self.root / "munge"
        self._spawn(
            "munged",
            [
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        self._wait_until(lambda: self.munge_socket.exists(), 10, "munged's socket to appear")

    def start(self, config: SlurmConfig) -> None:
        """(Re)starts slurmctld and slurmd with ``config``, on a clean job state."""
        self._resolve_proctrack(config)  # skips the test before anything stops
        self.stop_slurm()
        self.write_config(config)
        self._spawn("slurmctld", ["-D", "-c", "-i"])
        self._spawn("slurmd", ["-D"])
        self._wait_until(self._node_idle, START_TIMEOUT_S, f"node {self.host} to be idle in sinfo")

    def _node_idle(self) -> bool:
        for name, proc in self._daemons.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} at start\n{self.diagnostics()}")
        result = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return result.returncode == 0 and f"{self.host} idle" in result.stdout.split("\n")

    def _wait_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")
            time.sleep(0.2)

    def _job_processes(self) -> list[psutil.Process]:
        """Processes left by this cluster's jobs: slurmstepd and the tasks inherit SLURM_CONF."""
        mine, found = str(self.conf), []
        daemons = {proc.pid for proc in self._daemons.values()}
        for proc in psutil.process_iter():
            if proc.pid == os.getpid() or proc.pid in daemons:
                continue
            try:
                if proc.environ().get("SLURM_CONF") == mine:
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def stop_slurm(self) -> None:
        """Cancels every job, stops slurmd and slurmctld by pid, then any process a job left."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            self.run("scancel", "--user=root", "--full", check=False)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                queue = self.run("squeue", "-h", "-o", "%i", check=False)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld"):
            self._stop(name)
        for proc in self._job_processes():
            try:
                proc.kill()
            except psutil.Error:
                pass

    def _stop(self, name: str) -> None:
        proc = self._daemons.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def stop(self) -> None:
        self.stop_slurm()
        self._stop("munged")
        # The Ray temp dirs this cluster's jobs left (those that ended by scancel or a
        # preemption cannot remove theirs): each holds its job's mark.
        for folder in Path("/tmp").glob("dapo-ray-*-*"):
            job = folder.name.split("-")[2]
            if job.isdigit() and self.first_job_id <= int(job) < self.first_job_id + 100_000:
                if not folder.is_symlink() and list(folder.glob(f".made-by-job-{job}-attempt-*")):
                    shutil.rmtree(folder, ignore_errors=True)

    def diagnostics(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out", "munged.out"):
            parts.append(f"--- {name} (last lines) ---\n{_tail(self.root / 'log' / name)}")
        parts.append(f"--- munged.log ---\n{_tail(self.root / 'munge' / 'munged.log', 10)}")
        return "\n".join(parts)

    # ---- clients ------------------------------------------------------------------------
    def run(self, *args: str, check: bool = True, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [self._program(args[0]), *args[1:]], env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {result.returncode}\n{result.stdout}{result.stderr}")
        return result

    def sbatch(self, script: Path | str, *args: str, options: tuple[str, ...] = (), cwd: Path | str) -> str:
        """Submits as a user does, from ``cwd``; returns the job id."""
        result = self.run("sbatch", "--parsable", *options, str(script), *args, cwd=cwd)
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` fields (JobState, ExitCode, Restarts, Reason, StdOut, ...)."""
        result = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if result.returncode != 0 or not result.stdout.strip():
            raise RuntimeError(f"scontrol show job {job_id}: {result.stdout}{result.stderr}")
        return parse_fields(result.stdout.strip().splitlines()[0])

    def wait(self, job_id: str, timeout: float = 60, states=FINAL_STATES) -> dict[str, str]:
        """The job's fields once its JobState is one of ``states``; fails after ``timeout``
        seconds with the job, its output and the daemons' logs."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} not in {sorted(states)} after {timeout:.0f}s: {fields}\n"
                    f"--- its output ---\n{_tail(Path(fields.get('StdOut', '/nonexistent')))}\n{self.diagnostics()}"
                )
            time.sleep(0.25)

    def output(self, fields: dict[str, str]) -> str:
        return Path(fields["StdOut"]).read_text(errors="replace")


@pytest.fixture(scope="session")
def slurm_cluster():
    """The session's cluster (started with the default config); tests use ``slurm``."""
    reason = _install()
    if reason:
        pytest.skip(reason)
    with open(LOCK_FILE, "a") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.skip(f"another test session has held the one-node SLURM ({LOCK_FILE}) for {LOCK_WAIT_S}s")
                time.sleep(1)
        # munged wants every folder up to its socket searchable by all: not pytest's tmp_path (0700).
        root = Path(tempfile.mkdtemp(prefix="dapo-slurm-"))
        root.chmod(0o755)
        cluster = SlurmCluster(root)
        try:
            cluster.start_munge()
            cluster.start(SlurmConfig())
            yield cluster
        finally:
            cluster.stop()
            if not os.environ.get("DAPO_KEEP_SLURM_DIR"):
                shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster, request) -> SlurmCluster:
    """The cluster, configured as the test's ``slurm_config`` mark asks (default: SlurmConfig())."""
    mark = request.node.get_closest_marker("slurm_config")
    config = SlurmConfig(**mark.kwargs) if mark else SlurmConfig()
    if config != slurm_cluster.config:
        slurm_cluster.start(config)
    return slurm_cluster


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slurm_config(**kwargs): run the test on the real one-node SLURM configured with SlurmConfig(**kwargs)",
    )
