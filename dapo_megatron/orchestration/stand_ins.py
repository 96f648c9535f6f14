"""Stand-ins for the actor's ranks and the rollout engines: Ray actors that only report
where Ray put them.

The placement rehearsal (:mod:`dapo_megatron.rehearsal`) starts these through the same
:class:`ActorGroup` and :class:`RolloutWorkers` code as ``train``, with the same Ray
options, on a Ray instance that declares the job's GPU cluster. They answer the calls
that placement makes (rendezvous, setup, start, health, placement) and nothing else, and
this module imports neither torch nor megatron, so that each of the recipe's 160 stand-in
processes starts in about the time Ray itself takes.
"""

from __future__ import annotations

import os
from typing import Optional

import ray

from dapo_megatron.config import Config
from dapo_megatron.orchestration.placement import engine_start_gpus, rank_coordinates


def _where() -> dict:
    """The Ray node, the GPUs Ray assigned and ``CUDA_VISIBLE_DEVICES`` as Ray set it."""
    context = ray.get_runtime_context()
    return {
        "node": context.get_node_id(),
        "ray_gpu_ids": [int(i) for i in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
    }


@ray.remote
class StandInRank:
    """An actor rank's place: its megatron coordinates and the GPU Ray gave it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.info: Optional[dict] = None

    def rendezvous_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), 0

    def setup(
        self, rank: int, world_size: int, master_addr: str, master_port: int, cores: Optional[list[int]] = None
    ) -> dict:
        """What :meth:`ActorRank.setup` returns, from megatron's rank order (no runtime)."""
        self.info = {
            "rank": rank,
            "world_size": world_size,
            "device": "cuda:0",
            "backend": "nccl",
            **rank_coordinates(self.config.parallel, rank),
            "pid": os.getpid(),
        }
        return self.info

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def placement(self) -> tuple[str, list[int]]:
        return self.node_id(), [int(i) for i in ray.get_gpu_ids()]

    def report(self) -> dict:
        return {**_where(), **(self.info or {})}

    def shutdown(self) -> None:
        pass


@ray.remote
class StandInEngine:
    """A rollout engine's place: the GPUs it would build on, as :class:`EngineWorker` decides them."""

    def __init__(
        self,
        config: Config,
        index: int,
        num_threads: int,
        weights_dir: Optional[str] = None,
        cores: Optional[list[int]] = None,
    ) -> None:
        self.config, self.index = config, index
        self.base_gpu_id: Optional[int] = None
        self.gpus: list[int] = []

    def start(self, base_gpu_id: Optional[int] = None) -> None:
        self.base_gpu_id, self.gpus = engine_start_gpus(self.config, base_gpu_id, [int(i) for i in ray.get_gpu_ids()])

    def health(self) -> dict:
        return {"index": self.index, "pid": os.getpid()}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def placement(self) -> tuple[str, list[int]]:
        return self.node_id(), self.gpus

    def report(self) -> dict:
        return {**_where(), "index": self.index, "base_gpu_id": self.base_gpu_id, "gpus": self.gpus}

    def shutdown(self) -> None:
        pass
