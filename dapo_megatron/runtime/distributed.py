"""One entry point that brings up and tears down a rank of the actor.

Every process of the actor does the same three things before it touches a model:
initialise ``torch.distributed`` (NCCL on GPU, gloo on the CPU), build megatron's
tensor/pipeline/data/context-parallel groups from :class:`ParallelConfig`, and seed
megatron's RNG trackers. Doing it in one place means the CPU runtime (megatron's CUDA
calls redirected, see :mod:`cpu_compat`) is switched on exactly when the run asks for
it, and that teardown undoes all of it, so tests can run several layouts in sequence.

Rank, world size and rendezvous come from the usual environment variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) as set by torchrun,
SLURM wrappers or :mod:`dapo_megatron.runtime.launch`; a single process without them
runs as world size 1.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dapo_megatron.config import ParallelConfig, data_parallel_size
from dapo_megatron.runtime import cpu_compat

logger = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """The process environment does not match the requested layout."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What a rank knows about itself once the runtime is up."""

    device: torch.device
    """Device of this rank's tensors (``cpu`` on the CPU runtime)."""
    backend: str
    """torch.distributed backend: ``nccl`` or ``gloo``."""
    rank: int
    """Global rank."""
    world_size: int
    """Number of ranks."""
    tp_rank: int
    """Rank inside the tensor-parallel group."""
    pp_rank: int
    """Pipeline stage of this rank."""
    dp_rank: int
    """Rank inside the data-parallel group."""
    cp_rank: int
    """Rank inside the context-parallel group."""

    @property
    def is_cpu(self) -> bool:
        """Whether this rank runs megatron on the CPU runtime."""
        return self.device.type == "cpu"


def resolve_device(requested: str) -> str:
    """``cpu`` or ``cuda`` for a ``parallel.device`` setting of auto/cpu/cuda."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise LaunchError(
            "parallel.device=cuda but no GPU is visible to torch; use parallel.device=cpu "
            "(or auto) to run on the CPU runtime"
        )
    return requested


def find_free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_rank_of(env, parallel: ParallelConfig, device_type: str) -> int:
    """This process's rank on its node, which picks its GPU: ``LOCAL_RANK`` as torchrun,
    SLURM's launcher or the Ray actor group set it. Unset, the global rank is the local
    one only on a single node (or on the CPU, where no device is picked); on several GPU
    nodes it would name a GPU the node does not have, so that is refused."""
    if "LOCAL_RANK" in env:
        return int(env["LOCAL_RANK"])
    rank = int(env.get("RANK", "0"))
    if device_type == "cpu" or parallel.num_nodes == 1:
        return rank
    raise LaunchError(
        f"LOCAL_RANK is not set on a {parallel.num_nodes}-node GPU launch (global rank {rank}): launch with "
        "torchrun, srun with LOCAL_RANK exported (SLURM_LOCALID), or `dapo-megatron train` (Ray sets it)"
    )


def initialize_runtime(parallel: ParallelConfig, seed: int) -> RuntimeInfo:
    """Initialise torch.distributed, megatron's parallel state and RNG for this rank.

    Args:
        parallel: the run's layout; its world size must equal the launched world size.
        seed: base seed; megatron derives the tensor-parallel and data-parallel seeds.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    device_type = resolve_device(parallel.device)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = local_rank_of(os.environ, parallel, device_type)
    if world_size != parallel.world_size:
        raise LaunchError(
            f"launched {world_size} processes but the layout needs parallel.num_nodes x "
            f"parallel.num_devices_per_node = {parallel.world_size}"
        )
    # A lone process gets its own rendezvous port rather than inheriting (and leaking into
    # child processes) MASTER_PORT, which a previous run in this process may still hold.
    init_method = f"tcp://127.0.0.1:{find_free_port()}" if world_size == 1 else "env://"

    if device_type == "cpu":
        cpu_compat.enable_cpu_runtime(allow_with_gpu=parallel.device == "cpu")
        backend, device = "gloo", torch.device("cpu")
    else:
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", torch.device("cuda", local_rank)

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=parallel.timeout_minutes),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp_size,
        pipeline_model_parallel_size=parallel.pp_size,
        context_parallel_size=parallel.cp_size,
        distributed_timeout_minutes=parallel.timeout_minutes,
        create_gloo_process_groups=backend == "gloo" or parallel.use_distributed_optimizer,
    )
    # The same seed on every rank for Python/NumPy-level randomness; megatron offsets the
    # tensor-parallel tracker by tp rank itself.
    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    info = RuntimeInfo(
        device=device,
        backend=backend,
        rank=rank,
        world_size=world_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
    )
    expected_dp = data_parallel_size(parallel)
    if parallel_state.get_data_parallel_world_size() != expected_dp:
        shutdown_runtime()
        raise LaunchError(
            f"megatron built a data-parallel group of {parallel_state.get_data_parallel_world_size()} "
            f"ranks but parallel.dp_size resolves to {expected_dp}"
        )
    logger.debug("rank %d up: %s", rank, info)
    return info


def shutdown_runtime() -> None:
    """Destroy megatron's groups and the process group; undo the CPU runtime."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    cpu_compat.disable_cpu_runtime()


@contextlib.contextmanager
def megatron_runtime(parallel: ParallelConfig, seed: int) -> Iterator[RuntimeInfo]:
    """``with megatron_runtime(cfg.parallel, cfg.trainer.seed) as info:`` brings a rank
    up and always tears it down, also when the body raises."""
    info = initialize_runtime(parallel, seed)
    try:
        yield info
    finally:
        shutdown_runtime()
