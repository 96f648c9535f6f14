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

**Nothing listens on every interface.** torch's rendezvous store (a ``TCPStore``, which
has no authentication) listens on the wildcard address when torch creates it, so rank 0
hosts it here on ``MASTER_ADDR`` only (:func:`rendezvous_store`), and gloo's pair
listeners are pinned to the interface this rank reaches ``MASTER_ADDR`` from
(:func:`gloo_interface`; ``GLOO_SOCKET_IFNAME``, unless the launch sets it). On one
machine that is the loopback address; on a cluster, the node's address on the network
the ranks share.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dapo_megatron.config import ParallelConfig
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
    ep_rank: int = 0
    """Rank inside the expert-parallel group (which experts this rank holds)."""
    expert_dp_rank: int = 0
    """Rank among the ranks that hold the same experts (the expert-data-parallel group)."""

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


GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
"""The interface(s) gloo's pair listeners bind to; read whenever a gloo group is created."""
_runtime_pinned_gloo = False  # whether initialize_runtime set GLOO_IFNAME (shutdown unsets it)


def _socket_address(address: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """``address`` (an IP address or a host name) resolved for a TCP socket."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise LaunchError(f"cannot resolve the rendezvous address {address!r}: {exc}; use an IP address") from exc
    return family, sockaddr


def find_free_port(address: str = "127.0.0.1") -> int:
    """A TCP port on ``address`` (this machine's loopback address by default) that is free right now."""
    family, sockaddr = _socket_address(address, 0)
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(sockaddr)
        return sock.getsockname()[1]


def is_loopback(address: str) -> bool:
    """Whether ``address`` (or the address a host name resolves to) is a loopback address."""
    return ipaddress.ip_address(_socket_address(address, 0)[1][0]).is_loopback


def local_address_towards(address: str) -> str:
    """This machine's address on the route to ``address``: the address itself when it is
    one of this machine's (the loopback address included), else the address of the
    interface the kernel sends from. Connecting a UDP socket sends nothing."""
    family, sockaddr = _socket_address(address, 9)
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of this machine's network interface that has ``address``."""
    import psutil

    wanted = ipaddress.ip_address(address)
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(ValueError):
                    if ipaddress.ip_address(entry.address.split("%")[0]) == wanted:
                        return name
    raise LaunchError(
        f"no network interface of this machine has the address {address}, which it would reach the "
        f"rendezvous from; set {GLOO_IFNAME} to the interface the ranks talk over"
    )


def _pin_gloo_interface(address: str) -> bool:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface this process reaches ``address`` from,
    unless it is set already (by the launch or an enclosing runtime); whether it set it."""
    if os.environ.get(GLOO_IFNAME):
        return False
    os.environ[GLOO_IFNAME] = interface_of(local_address_towards(address))
    return True


@contextlib.contextmanager
def gloo_interface(address: str) -> Iterator[None]:
    """Inside the block, gloo groups this process creates listen on the interface it
    reaches ``address`` from (not the one its host name resolves to, which may face
    another network); ``GLOO_SOCKET_IFNAME`` when set wins."""
    pinned = _pin_gloo_interface(address)
    try:
        yield
    finally:
        if pinned:
            os.environ.pop(GLOO_IFNAME, None)


def rendezvous_store(
    address: str, port: int, world_size: int, *, host: bool, timeout: datetime.timedelta
) -> torch.distributed.TCPStore:
    """A group's TCP store at ``address:port``: hosted by this process when ``host`` (its
    rank 0), else a client of it.

    torch's store server binds the wildcard address; a store has no authentication, so the
    host binds the listening socket itself, to ``address`` only, and hands it to the store
    (``master_listen_fd``), which owns it from then on.
    """
    if not host:
        return torch.distributed.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    family, sockaddr = _socket_address(address, port)
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise LaunchError(
            f"rank 0 cannot listen on the rendezvous address {address}:{port} ({exc}): the address must be "
            "one of rank 0's own (MASTER_ADDR on torchrun or SLURM launches) and the port free"
        ) from exc
    bound_port = listener.getsockname()[1]
    descriptor = listener.detach()
    try:
        return torch.distributed.TCPStore(
            address, bound_port, world_size, is_master=True, timeout=timeout, master_listen_fd=descriptor
        )
    except BaseException:
        os.close(descriptor)
        raise


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


def rendezvous_from_env(env, parallel: ParallelConfig) -> tuple[str, int]:
    """``MASTER_ADDR`` and ``MASTER_PORT`` of a launch of several ranks. A loopback
    address across several nodes is refused: the other nodes could not reach rank 0."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise LaunchError(
            f"{' and '.join(missing)} not set for a launch of {env.get('WORLD_SIZE')} ranks: launch with "
            "torchrun, srun with both exported (rank 0's address and a free port), or `dapo-megatron train`"
        )
    address = env["MASTER_ADDR"]
    if parallel.num_nodes > 1 and is_loopback(address):
        raise LaunchError(
            f"MASTER_ADDR={address} is a loopback address on rank {env.get('RANK', '0')}'s machine but the "
            f"layout spans {parallel.num_nodes} nodes: set MASTER_ADDR to rank 0's IP address on the network the "
            "nodes share"
        )
    return address, int(env["MASTER_PORT"])


def initialize_runtime(parallel: ParallelConfig, seed: int) -> RuntimeInfo:
    """Initialise torch.distributed, megatron's parallel state and RNG for this rank.

    Args:
        parallel: the run's layout; its world size must equal the launched world size.
        seed: base seed; megatron derives the tensor-parallel and data-parallel seeds.
    """
    global _runtime_pinned_gloo
    device_type = resolve_device(parallel.device)
    if device_type == "cpu":
        cpu_compat.import_megatron_uncompiled()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

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
    if world_size == 1:
        master_addr, master_port = "127.0.0.1", find_free_port()
    else:
        master_addr, master_port = rendezvous_from_env(os.environ, parallel)

    if device_type == "cpu":
        cpu_compat.enable_cpu_runtime(allow_with_gpu=parallel.device == "cpu")
        backend, device = "gloo", torch.device("cpu")
    else:
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", torch.device("cuda", local_rank)

    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(minutes=parallel.timeout_minutes)
        # Every gloo group of the run (megatron's included) is created while this is set.
        pinned = _pin_gloo_interface(master_addr)
        # Under torchrun (elastic agent store) the agent hosts the store; rank 0 connects too.
        agent_hosts = world_size > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        try:
            store = rendezvous_store(
                master_addr, master_port, world_size, host=rank == 0 and not agent_hosts, timeout=timeout
            )
            torch.distributed.init_process_group(
                backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        except BaseException:
            if pinned:
                os.environ.pop(GLOO_IFNAME, None)
            raise
        _runtime_pinned_gloo = pinned or _runtime_pinned_gloo
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp_size,
        pipeline_model_parallel_size=parallel.pp_size,
        context_parallel_size=parallel.cp_size,
        expert_model_parallel_size=parallel.ep_size,
        expert_tensor_parallel_size=1,
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
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
    )
    expected_dp = parallel.data_parallel_size
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

    global _runtime_pinned_gloo
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if _runtime_pinned_gloo:
        os.environ.pop(GLOO_IFNAME, None)
        _runtime_pinned_gloo = False
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
