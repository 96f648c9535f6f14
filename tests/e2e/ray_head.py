"""A Ray head of the tests' own, for the end-to-end runs that do not test Ray itself to
join (``ray.address``) instead of starting and stopping an instance each (Ray's start and
stop are about 3.5 s of a run's 5-9 s here).

It is made as :class:`~dapo_megatron.orchestration.cluster.PrivateRay` makes a local
instance: loopback only (Ray's single-machine mode) and a fresh token, in a file only the
user can read, that every client needs. It is started by ``ray start``, so its daemons are
not descendants of the test process (the socket checks list that process's tree), and it
is stopped by killing its processes, found by its temp folder (a fresh ``mkdtemp``) and
token, and nothing else; a watchdog does that too if the test process dies without
stopping it. Run as ``python -m tests.e2e.ray_head <pid> <folder>``: that watchdog.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from dapo_megatron.orchestration.cluster import TOKEN_FILE, write_token

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def processes_of(folder: Path) -> list[psutil.Process]:
    """Every process of the head in ``folder``: those whose command line names the folder
    (its daemons) or whose environment names its token (what they start: workers), and
    their descendants (agents, whose titles hide both); never this process, its ancestors
    or its descendants (a test process that joined the head names the token, and so do the
    processes it started meanwhile: its reward workers, multiprocessing's resource tracker)."""
    token = str(folder / TOKEN_FILE).encode()
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents()), *(p.pid for p in me.children(recursive=True))}
    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter(["cmdline"]):
        if process.pid in mine:
            continue
        try:
            if not any(str(folder) in part for part in process.info["cmdline"] or ()):
                with open(f"/proc/{process.pid}/environ", "rb") as environ:  # raw: a process title may garble it
                    if token not in environ.read():
                        continue
            found.update({p.pid: p for p in [process, *process.children(recursive=True)] if p.pid not in mine})
        except (psutil.Error, OSError):  # ended meanwhile, or another user's
            continue
    return list(found.values())


def stop(folder: Path) -> None:
    """Kill every process of the head in ``folder`` (its state is thrown away) until none is
    left (its raylet may start a worker meanwhile), then remove the folder."""
    for _ in range(10):
        processes = processes_of(folder)
        if not processes:
            break
        for process in processes:
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(processes, timeout=5)
    else:
        raise RuntimeError(f"processes of the Ray head in {folder} outlived ten rounds of SIGKILL")
    shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def ray_head(num_cpus: int = 8) -> Iterator[tuple[str, Path]]:
    """``(address, token file)`` of a head of ``num_cpus`` CPUs inside the block (see the
    module docstring); this process's environment is not changed."""
    folder = Path(tempfile.mkdtemp(prefix="dapo-e2e-ray-"))  # short: Ray's socket paths
    token = folder / TOKEN_FILE
    write_token(token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    port = _free_port()
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}", f"--num-cpus={num_cpus}"]
    command += ["--num-gpus=0", "--include-dashboard=false", f"--temp-dir={folder}", "--disable-usage-stats"]
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.ray_head", str(os.getpid()), str(folder)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.DEVNULL,
    )
    try:
        started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        if started.returncode != 0:
            raise RuntimeError(f"ray start failed: {started.stdout[-2000:]}{started.stderr[-2000:]}")
        yield f"127.0.0.1:{port}", token
    finally:
        try:
            stop(folder)
        finally:
            watchdog.kill()
            watchdog.wait()


def _watch(pid: int, folder: Path) -> None:
    """Stop the head in ``folder`` once process ``pid`` (which started it) has ended; end
    quietly when the folder is gone (the head was stopped)."""
    while folder.exists():
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            stop(folder)
            return
        time.sleep(1.0)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), Path(sys.argv[2]))
