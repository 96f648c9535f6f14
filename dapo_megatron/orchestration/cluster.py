"""Start a local Ray instance for a run, or join an existing cluster, and stop only ours.

By default ``train`` starts a private Ray instance whose temporary folder (sockets, logs,
object spill) lives inside the run folder, and shuts it down at the end, also on an error
or Ctrl-C, so nothing keeps running afterwards and nothing is written to ``~/.ray`` or
``/tmp/ray``. With ``ray.address`` set (``train.sbatch`` passes the head it started), the
run joins that cluster and leaves it running: it was started by someone else.

Unix socket paths are limited to 107 bytes; when the run folder is too deep for Ray's
socket paths, the instance's folder is a short one under the system temp folder, linked
from the run folder as ``ray`` while it runs and moved there (logs included) when it stops.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from dapo_megatron.config import RayConfig

logger = logging.getLogger(__name__)

# Longest suffix Ray appends to its temp folder: /session_<date>_<time>_<us>_<pid>/sockets/plasma_store
# (61 characters with a 4-digit pid; room for a 7-digit one).
_RAY_SOCKET_SUFFIX = 64
_UNIX_PATH_MAX = 107


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

    def __enter__(self) -> RayCluster:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Workers see the driver's environment (thread counts, the CPU runtime).
        runtime_env = {
            "env_vars": {
                "RAY_AUTH_MODE": "disabled",
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
        ray.init(
            num_cpus=self.num_cpus,
            num_gpus=None,
            _temp_dir=str(temp_dir),
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=True,
            runtime_env=runtime_env,
        )
        self.started_here = True
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        """Disconnect; shut the instance down only when this process started it."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
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
