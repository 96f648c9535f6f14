"""Start a local Ray instance for a run, or join an existing cluster, and stop only ours.

By default ``train`` starts a private Ray instance whose temporary folder (sockets, logs,
object spill) lives inside the run folder, and shuts it down at the end, also on an error
or Ctrl-C, so nothing keeps running afterwards and nothing is written to ``~/.ray`` or
``/tmp/ray``. With ``ray.address`` set (``train.sbatch`` passes the head it started), the
run joins that cluster and leaves it running: it was started by someone else.

**Who may use it.** A Ray instance runs whatever a client that reaches its port submits.
The local instance therefore listens on 127.0.0.1 only and requires a token (Ray's
``RAY_AUTH_MODE=token``): a fresh secret per instance, in a file only the user can read
inside the instance's folder (removed when it stops), named to the driver and, through
the environment, to every worker; a client without it is refused. Ray has no option to
bind a Linux node to the loopback address (``ray.init(_node_ip_address="127.0.0.1")`` is
replaced by the machine's address); its single-machine mode, which it uses on macOS and
Windows (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), does exactly that, so the local
instance runs in that mode. :class:`PrivateRay` does both (the placement rehearsal's
simulated cluster uses it too). A joined cluster keeps its own settings: the driver takes
``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN_PATH`` from the environment, which
``train.sbatch`` sets for the cluster it starts.

Unix socket paths are limited to 107 bytes; when the run folder is too deep for Ray's
socket paths, the instance's folder is a short one under the system temp folder, linked
from the run folder as ``ray`` while it runs and moved there (logs included) when it stops.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from dapo_megatron.config import Config, RayConfig

logger = logging.getLogger(__name__)

# Longest suffix Ray appends to its temp folder: /session_<date>_<time>_<us>_<pid>/sockets/plasma_store
# (61 characters with a 4-digit pid; room for a 7-digit one).
_RAY_SOCKET_SUFFIX = 64
_UNIX_PATH_MAX = 107
TOKEN_FILE = "auth_token"
"""The local instance's secret, inside its folder (mode 0600, removed when it stops)."""
_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")


_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, Ray runs as one machine on the loopback address (its macOS/Windows mode)."""


def _set_ray_cluster_mode(enabled: bool) -> bool:
    """Switch this process's Ray between cluster mode and loopback-only; the old value."""
    from ray._private import ray_constants

    previous = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = enabled
    return previous


def _reload_ray_auth_settings() -> None:
    """Make this process's Ray read ``RAY_AUTH_*`` again: it reads them once, when first
    imported, and caches the token (as Ray's own tests do between clusters)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def write_token(path: Path) -> None:
    """A fresh Ray secret in ``path``, created exclusively (never through a link) with mode
    0600: only the user can read it."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secrets.token_hex(32))


class PrivateRay:
    """``with PrivateRay(folder):`` the Ray instance this process starts inside the block
    (and every process that instance starts) listens on the loopback address only and
    requires a token: a fresh secret in ``folder / TOKEN_FILE``, created exclusively with
    mode 0600 (an earlier instance's file there is replaced). On leaving, the file is
    removed and this process's environment and Ray settings are as they were. Enter it
    before starting the instance, leave it once the instance has stopped.

    With ``join=True`` the block talks to an instance someone else started that way (its
    secret already in ``folder / TOKEN_FILE``): the file is used as it is and kept.
    """

    def __init__(self, folder: str | os.PathLike, *, join: bool = False) -> None:
        self.token_file = Path(folder) / TOKEN_FILE
        self._join = join
        self._saved_env: dict[str, Optional[str]] = {}
        self._saved_cluster_mode = True
        self._active = False

    def __enter__(self) -> PrivateRay:
        if self._active:
            raise RuntimeError("this PrivateRay is already in use")
        if self._join:
            if not self.token_file.is_file():
                raise FileNotFoundError(f"no Ray token to join with at {self.token_file}")
        else:
            self.token_file.unlink(missing_ok=True)
            write_token(self.token_file)
        self._saved_env = {name: os.environ.get(name) for name in _AUTH_VARIABLES + (_SINGLE_MACHINE,)}
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_file))
        # Loopback only: the driver decides the node's address now; the processes Ray
        # starts read the variable when they import it.
        os.environ[_SINGLE_MACHINE] = "0"
        self._saved_cluster_mode = _set_ray_cluster_mode(False)
        self._active = True
        _reload_ray_auth_settings()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Remove the secret and restore the settings (once; later calls do nothing)."""
        if not self._active:
            return
        self._active = False
        if not self._join:
            self.token_file.unlink(missing_ok=True)
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _set_ray_cluster_mode(self._saved_cluster_mode)
        _reload_ray_auth_settings()


class RayCluster:
    """``with RayCluster(config.ray, run_dir, num_cpus):`` Ray is up inside the block.

    Args:
        ray_config: the ``ray`` section (``address`` to join a cluster).
        run_dir: the run folder; a local instance keeps its files in ``run_dir/ray``.
        num_cpus: logical CPUs of a local instance (each actor rank and engine takes one).
    """

    def __init__(self, ray_config: RayConfig, run_dir: str | os.PathLike, num_cpus: int) -> None:
        self.config = ray_config
        self.run_dir = Path(run_dir)
        self.num_cpus = num_cpus
        self.started_here = False
        self._short_dir: Optional[Path] = None
        self._link: Optional[Path] = None
        self._private: Optional[PrivateRay] = None
        self._token_file: Optional[Path] = None

    def __enter__(self) -> RayCluster:
        import ray

        # Workers see the driver's environment (thread counts, the CPU runtime).
        runtime_env = {
            "env_vars": {
                "TOKENIZERS_PARALLELISM": "false",
                # megatron-core warns at import about optional GPU kernels, once per process.
                "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning",
            }
        }
        if ray.is_initialized():
            raise RuntimeError("Ray is already initialised in this process; train starts or joins it itself")
        if self.config.address:
            logger.info("joining the Ray cluster at %s", self.config.address)
            ray.init(address=self.config.address, runtime_env=runtime_env, logging_level="ERROR")
            return self
        temp_dir = self._temp_dir()
        logger.info(
            "starting a local Ray instance (%d CPUs) in %s%s",
            self.num_cpus,
            temp_dir,
            f" (linked from {self._link}: the run folder's path is too long for Ray's sockets)"
            if self._short_dir
            else "",
        )
        self._make_private(temp_dir)
        try:
            ray.init(
                # A new instance even where `ray start` left one running on this machine
                # (ray.init alone would join it, with its settings and without ours).
                address="local",
                num_cpus=self.num_cpus,
                num_gpus=None,
                _temp_dir=str(temp_dir),
                include_dashboard=False,
                logging_level="ERROR",
                log_to_driver=True,
                runtime_env=runtime_env,
                # No idle workers started for the driver: every actor of a run has its own
                # runtime environment, so they would go unused, taking CPU while the ranks
                # import (about 0.8 s of a small run's start on two cores).
                _system_config={"prestart_worker_first_driver": False},
            )
        except BaseException:
            self._end_private()
            raise
        self.started_here = True
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        """Disconnect; shut the instance down only when this process started it."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self._end_private()
        if self._short_dir is not None:
            # Keep the instance's logs with the run: the folder moves in place of its link.
            link = self._link
            if link.is_symlink():
                link.unlink()
            try:
                shutil.move(str(self._short_dir), str(link))
            except OSError as exc:
                logger.warning("could not move Ray's folder %s into the run folder: %s", self._short_dir, exc)
                shutil.rmtree(self._short_dir, ignore_errors=True)
            self._short_dir = None

    def _make_private(self, folder: Path) -> None:
        """Loopback only, and a fresh secret readable by the user only that Ray is told to require."""
        self._private = PrivateRay(folder).__enter__()
        self._token_file = self._private.token_file

    def _end_private(self) -> None:
        if self._private is None:
            return
        self._private.close()
        self._private = None
        self._token_file = None

    def _temp_dir(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        wanted = (self.run_dir / "ray").resolve()
        if len(str(wanted)) + _RAY_SOCKET_SUFFIX <= _UNIX_PATH_MAX:
            wanted.mkdir(parents=True, exist_ok=True)
            return wanted
        self._short_dir = Path(tempfile.mkdtemp(prefix="dapo-ray-"))
        # An earlier instance's folder stays untouched; this one gets a name of its own.
        link = self.run_dir / "ray"
        if link.is_symlink() and not link.exists():
            link.unlink()  # a dangling link of an instance that was killed
        if link.exists() or link.is_symlink():
            link = self.run_dir / f"ray-{os.getpid()}"
        try:
            link.symlink_to(self._short_dir, target_is_directory=True)
        except OSError:
            shutil.rmtree(self._short_dir, ignore_errors=True)
            self._short_dir = None
            raise
        self._link = link
        return self._short_dir


def separate_cpu_cores(config: Config) -> Optional[tuple[list[list[int]], list[list[int]]]]:
    """Cores for each actor rank and each engine, apart from one another
    (``ray.separate_cores``; by default when engines generate while the actor trains,
    ``trainer.async_generation``) on the CPU runtime of one local machine: one core per
    rank, the rest shared out among the engines. None when that does not apply or the
    machine has too few cores (logged)."""
    wanted = config.ray.separate_cores
    if wanted is None:
        wanted = config.trainer.async_generation
    if not (wanted and config.parallel.device == "cpu"):
        return None
    if config.ray.address is not None or config.parallel.num_nodes != 1 or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    ranks, engines = config.parallel.world_size, config.rollout.num_engines
    if len(cores) < ranks + engines:
        logger.info("%d cores cannot give %d actor rank(s) and %d engine(s) one each", len(cores), ranks, engines)
        return None
    spare = cores[ranks:]
    share = len(spare) // engines
    return [[core] for core in cores[:ranks]], [spare[i * share : (i + 1) * share] for i in range(engines)]


def async_shares_devices(config: Config) -> Optional[str]:
    """Why generation running ahead (``trainer.async_generation``) competes with training
    for the same devices in this layout, or None when it does not (or the run is sync).
    Overlap only pays when generation and training run on devices of their own: on a
    shared 2-core machine the demo's async steps were slower than its sync ones."""
    if not config.trainer.async_generation:
        return None
    if config.parallel.device == "cpu":
        if config.parallel.num_nodes != 1 or config.ray.address is not None:
            return None  # cores of other machines: not known here
        if separate_cpu_cores(config) is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            return (
                f"the {config.parallel.world_size} actor rank(s) and {config.rollout.num_engines} engine(s) share "
                f"this machine's {cores} cores (ray.separate_cores off, or fewer cores than ranks + engines)"
            )
        return None
    if config.rollout.colocate:
        return "the engines are colocated on the actor's GPUs (rollout.colocate=true)"
    return None


def pin_process(cores: list[int]) -> None:
    """Pin every thread of this process (and those it starts later) to ``cores``."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:  # a thread that ended meanwhile
            pass
