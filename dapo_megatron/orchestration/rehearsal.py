"""A rehearsal of the job's placement on a simulated cluster (``plan CONFIG --rehearse``).

No CPU test can show that a 128-GPU layout places by reading the code: the 32B recipe
once reserved every GPU for the actor and then asked for GPU shares outside that
reservation, which Ray never grants, and it would have hung at start on the cluster. The
rehearsal *executes* the placement instead, in seconds and without a GPU:

- a private local Ray cluster declares the config's nodes (``parallel.num_nodes`` of
  ``parallel.num_devices_per_node`` GPUs, plus spare nodes for separate engines), one
  raylet per node, as :class:`ray.cluster_utils.Cluster` runs them, on the loopback
  address only and requiring a token of its own (:class:`~.cluster.PrivateRay`, as the
  local instance of ``train``): it runs whatever a client that reaches it submits;
- :class:`ActorGroup` and :class:`RolloutWorkers` place every rank and every engine
  through the code ``train`` runs (same placement group, bundles, scheduling strategies,
  first-GPU choice and feeder choice), with stand-in actors (:mod:`stand_ins`) that only
  report where Ray put them;
- the resulting per-node map is checked (:func:`placement_problems`) and printed.

What cannot be placed fails once nothing has started for :func:`schedule_bound_s`
(60 s, more for many stand-ins), named with what it asked for and what the cluster has.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import ray

from dapo_megatron.config import Config
from dapo_megatron.orchestration.cluster import PrivateRay
from dapo_megatron.orchestration.placement import actor_on_gpu, engine_kind

logger = logging.getLogger(__name__)

REHEARSAL_SCHEDULE_TIMEOUT_S = 60.0
"""How long the rehearsal waits, with no stand-in starting, before naming those Ray has
not started (at least; see :func:`schedule_bound_s`)."""

SECONDS_PER_STAND_IN = 1.5
"""Allowance per stand-in process for that bound: on the simulated cluster every process
starts on this machine (the 32B recipe's 160 on a 2-core VM: none had started after
140 s, then about 3 a second)."""


def schedule_bound_s(config: Config) -> float:
    """The rehearsal's bound on a start with no progress, for ``config``'s ranks and engines."""
    members = config.parallel.world_size + config.rollout.num_engines
    return max(REHEARSAL_SCHEDULE_TIMEOUT_S, SECONDS_PER_STAND_IN * members)


_RAYLET_ENV = {
    # No idle workers prestarted per declared CPU (16 nodes x 32 CPUs would start 512).
    "RAY_prestart_worker_first_driver": "0",
    "RAY_enable_worker_prestart": "0",
    # All raylets share this machine's cores: start few workers at a time, wait longer.
    "RAY_worker_maximum_startup_concurrency": "1",
    "RAY_worker_register_timeout_seconds": "600",
}


def rehearsal_config(config: Config) -> Config:
    """``config`` as the cluster would run it: ``auto`` device and engine resolved as on a
    GPU node (unless the config says ``cpu``), on the rehearsal's own Ray instance."""
    parallel, rollout = config.parallel, config.rollout
    gpu = parallel.device != "cpu"
    if gpu:
        parallel = dataclasses.replace(parallel, device="cuda")
        if rollout.engine == "auto":
            rollout = dataclasses.replace(rollout, engine="sglang")
    ray_config = dataclasses.replace(config.ray, address=None)
    return dataclasses.replace(config, parallel=parallel, rollout=rollout, ray=ray_config)


def spare_nodes_needed(config: Config) -> int:
    """Nodes separate GPU engines need besides the actor's (their GPUs, whole engines per node)."""
    rollout = config.rollout
    if rollout.colocate or engine_kind(config) != "sglang":
        return 0
    per_node = max(1, config.parallel.num_devices_per_node // rollout.engine_tp_size)
    return -(-rollout.num_engines // per_node)


@dataclass
class RankPlace:
    """Where one actor rank landed."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    node: int
    gpus: list[int]
    cuda_visible_devices: Optional[str]


@dataclass
class EnginePlace:
    """Where one rollout engine landed and who feeds it."""

    index: int
    node: int
    gpus: list[int]
    base_gpu_id: Optional[int]
    cuda_visible_devices: Optional[str]
    feeder: Optional[int]


@dataclass
class Rehearsal:
    """The placement of one job on its simulated cluster."""

    num_nodes: int
    """Nodes of the actor (the first ``num_nodes`` of ``node_ids``)."""
    gpus_per_node: int
    colocate: bool
    engine_tp_size: int
    node_ids: list[str]
    """Ray's id of each simulated node: the actor's, in bundle order, then spare nodes."""
    ranks: list[RankPlace]
    engines: list[EnginePlace]
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


@contextmanager
def declared_cluster(num_nodes: int, gpus_per_node: int, cpus_per_node: int) -> Iterator[None]:
    """A private local Ray cluster of ``num_nodes`` raylets, each declaring
    ``gpus_per_node`` GPUs (none need exist) and ``cpus_per_node`` CPUs; connected to.
    Every process of it listens on the loopback address only and takes only clients
    holding its token (:class:`PrivateRay`; the token in a folder of its own, removed at
    the end)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise RuntimeError("the rehearsal starts its own Ray cluster: call it outside a Ray session")
    saved = {key: os.environ.get(key) for key in _RAYLET_ENV}
    os.environ.update(_RAYLET_ENV)
    # Workers start through a setup script that does not import Ray (see its docstring).
    setup = str(Path(__file__).with_name("rehearsal_worker_setup.py"))
    node_args = {"num_cpus": cpus_per_node, "num_gpus": gpus_per_node, "setup_worker_path": setup}
    secret_dir = tempfile.mkdtemp(prefix="dapo-rehearsal-")  # mode 0700
    try:
        with PrivateRay(secret_dir):
            cluster = Cluster(
                initialize_head=True, head_node_args={**node_args, "include_dashboard": False}, shutdown_at_exit=True
            )
            try:
                for _ in range(num_nodes - 1):
                    cluster.add_node(wait=False, **node_args)
                cluster.wait_for_nodes()
                ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
                yield
            finally:
                if ray.is_initialized():
                    ray.shutdown()
                cluster.shutdown()
    finally:
        shutil.rmtree(secret_dir, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rehearse(
    config: Config,
    cpus_per_node: int = 32,
    spare_nodes: Optional[int] = None,
    schedule_timeout_s: Optional[float] = None,
) -> Rehearsal:
    """Place ``config``'s job on a simulated cluster (see the module docstring) and check
    the map; ``spare_nodes`` for separate engines defaults to :func:`spare_nodes_needed`;
    ``schedule_timeout_s`` to :func:`schedule_bound_s`. Raises what ``train`` would raise
    when something cannot be placed."""
    from dapo_megatron.orchestration.actor_group import ActorGroup
    from dapo_megatron.orchestration.rollout import RolloutWorkers
    from dapo_megatron.orchestration.stand_ins import StandInEngine, StandInRank
    from dapo_megatron.weight_sync.gather import check_feeders

    config = rehearsal_config(config)
    parallel = config.parallel
    if schedule_timeout_s is None:
        schedule_timeout_s = schedule_bound_s(config)
    on_gpu = actor_on_gpu(parallel)
    spare = spare_nodes_needed(config) if spare_nodes is None else spare_nodes
    cpus = max(cpus_per_node, parallel.num_devices_per_node)
    with declared_cluster(parallel.num_nodes + spare, parallel.num_devices_per_node if on_gpu else 0, cpus):
        start = time.perf_counter()
        asked: list = []

        def ask_for_engines(group: ActorGroup) -> None:
            asked.append(
                RolloutWorkers(config, start=False, placement_group=group.placement_group, engine_actor=StandInEngine)
            )

        group = ActorGroup(
            config, while_ranks_start=ask_for_engines, rank_actor=StandInRank, schedule_timeout_s=schedule_timeout_s
        )
        engines = asked[0]
        engines.start(schedule_timeout_s=schedule_timeout_s)
        handles = engines.handles
        if config.rollout.colocate:
            feeders = group.plan_feeders(handles)
        else:
            feeders = {0: list(range(len(handles)))}
        check_feeders(feeders, group.valid_feeders)
        feeder_of = {engine: rank for rank, indices in feeders.items() for engine in indices}
        rank_reports = ray.get([rank.report.remote() for rank in group.ranks])
        engine_reports = ray.get([engine.report.remote() for engine in handles])
        table = ray.util.placement_group_table(group.placement_group)
        actor_nodes = [table["bundles_to_node_id"][i] for i in range(parallel.num_nodes)]
        others = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in actor_nodes)
        node_ids = actor_nodes + others
        seconds = time.perf_counter() - start
    index_of = {node: i for i, node in enumerate(node_ids)}
    rehearsal = Rehearsal(
        num_nodes=parallel.num_nodes,
        gpus_per_node=parallel.num_devices_per_node if on_gpu else 0,
        colocate=config.rollout.colocate,
        engine_tp_size=config.rollout.engine_tp_size if engine_kind(config) == "sglang" else 0,
        node_ids=node_ids,
        ranks=[
            RankPlace(
                r["rank"],
                r["tp_rank"],
                r["pp_rank"],
                r["dp_rank"],
                index_of[r["node"]],
                r["ray_gpu_ids"],
                r["cuda_visible_devices"],
            )
            for r in rank_reports
        ],
        engines=[
            EnginePlace(
                e["index"],
                index_of[e["node"]],
                e["gpus"],
                e["base_gpu_id"],
                e["cuda_visible_devices"],
                feeder_of.get(e["index"]),
            )
            for e in engine_reports
        ],
        seconds=seconds,
    )
    rehearsal.problems = placement_problems(rehearsal, config.parallel.tp_size)
    return rehearsal


EVAL_WEIGHTS_DIR = "/rehearsal/hf"
"""The HF folder the rehearsed ``eval`` engines are told to serve (stand-ins read nothing)."""


def rehearse_eval(config: Config, cpus_per_node: int = 32, schedule_timeout_s: Optional[float] = None) -> Rehearsal:
    """Place ``dapo-megatron eval``'s engines on a simulated cluster of the config's nodes:
    no actor, so no placement group; the engines are asked for as :func:`evaluate` asks
    (``RolloutWorkers(config, weights_dir)``), with stand-ins. The map is checked as for
    separate engines (each on ``engine_tp_size`` GPUs of one node that it alone uses, and
    sees as Ray's ``CUDA_VISIBLE_DEVICES``). ``cpus_per_node``: what each node declares;
    a real node's many CPUs are what let Ray pack GPU shares onto one node."""
    from dapo_megatron.orchestration.rollout import RolloutWorkers
    from dapo_megatron.orchestration.stand_ins import StandInEngine

    config = rehearsal_config(config)
    parallel = config.parallel
    if schedule_timeout_s is None:
        schedule_timeout_s = max(REHEARSAL_SCHEDULE_TIMEOUT_S, SECONDS_PER_STAND_IN * config.rollout.num_engines)
    gpus = parallel.num_devices_per_node if engine_kind(config) == "sglang" else 0
    with declared_cluster(parallel.num_nodes, gpus, cpus_per_node):
        start = time.perf_counter()
        engines = RolloutWorkers(config, EVAL_WEIGHTS_DIR, start=False, engine_actor=StandInEngine)
        engines.start(schedule_timeout_s=schedule_timeout_s)
        engine_reports = ray.get([engine.report.remote() for engine in engines.handles])
        node_ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        seconds = time.perf_counter() - start
    index_of = {node: i for i, node in enumerate(node_ids)}
    rehearsal = Rehearsal(
        num_nodes=0,  # no actor: every node is the engines'
        gpus_per_node=gpus,
        colocate=False,
        engine_tp_size=config.rollout.engine_tp_size if gpus else 0,
        node_ids=node_ids,
        ranks=[],
        engines=[
            EnginePlace(e["index"], index_of[e["node"]], e["gpus"], e["base_gpu_id"], e["cuda_visible_devices"], None)
            for e in engine_reports
        ],
        seconds=seconds,
    )
    rehearsal.problems = placement_problems(rehearsal, parallel.tp_size)
    return rehearsal


def placement_problems(rehearsal: Rehearsal, tp_size: int) -> list[str]:
    """What is wrong with a placement map, one line each (empty when nothing is):
    every actor GPU used by exactly one rank (Ray's ``CUDA_VISIBLE_DEVICES`` naming it),
    tensor-parallel groups inside a node, each engine on ``engine_tp_size`` GPUs of one
    node that no other engine uses, colocated engines on their node's rank GPUs and fed
    from their node, separate engines on GPUs no rank uses."""
    problems: list[str] = []
    r = rehearsal
    gpu_owner: dict[tuple[int, int], list[int]] = {}
    for place in r.ranks:
        if place.node >= r.num_nodes:
            problems.append(f"rank {place.rank} is on node {place.node}, not one of the actor's {r.num_nodes}")
        if r.gpus_per_node:
            if len(place.gpus) != 1:
                problems.append(f"rank {place.rank} owns GPUs {place.gpus}, not exactly one")
            elif place.cuda_visible_devices != str(place.gpus[0]):
                problems.append(
                    f"rank {place.rank}: CUDA_VISIBLE_DEVICES={place.cuda_visible_devices!r}, not its GPU {place.gpus[0]}"
                )
        for gpu in place.gpus:
            gpu_owner.setdefault((place.node, gpu), []).append(place.rank)
    for node in range(r.num_nodes):
        for gpu in range(r.gpus_per_node):
            owners = gpu_owner.get((node, gpu), [])
            if len(owners) != 1:
                problems.append(f"node {node} GPU {gpu} is used by {len(owners)} ranks {owners}, not exactly one")
    groups: dict[tuple[int, int], set[int]] = {}
    for place in r.ranks:
        groups.setdefault((place.pp_rank, place.dp_rank), set()).add(place.node)
    if tp_size <= max(r.gpus_per_node, 1):
        for (pp, dp), nodes in sorted(groups.items()):
            if len(nodes) > 1:
                problems.append(f"the tensor-parallel group of pp {pp}, dp {dp} spans nodes {sorted(nodes)}")
    engine_gpus: dict[tuple[int, int], list[int]] = {}
    rank_node = {place.rank: place.node for place in r.ranks}
    for engine in r.engines:
        name = f"engine {engine.index}"
        for gpu in engine.gpus:
            engine_gpus.setdefault((engine.node, gpu), []).append(engine.index)
        if r.engine_tp_size and len(engine.gpus) != r.engine_tp_size:
            problems.append(f"{name} has GPUs {engine.gpus}, not engine_tp_size={r.engine_tp_size}")
        if any(not 0 <= gpu < r.gpus_per_node for gpu in engine.gpus):
            problems.append(f"{name}'s GPUs {engine.gpus} are not all on its node (GPUs 0-{r.gpus_per_node - 1})")
        on_rank_gpus = [gpu for gpu in engine.gpus if (engine.node, gpu) in gpu_owner]
        if r.colocate:
            if engine.node >= r.num_nodes:
                problems.append(f"{name} (colocated) is on node {engine.node}, which has no actor rank")
            elif len(on_rank_gpus) != len(engine.gpus):
                problems.append(
                    f"{name} (colocated) uses GPUs {engine.gpus} that are not actor GPUs of node {engine.node}"
                )
            if engine.feeder is None:
                problems.append(f"{name} has no feeder")
            elif rank_node.get(engine.feeder) != engine.node:
                problems.append(
                    f"{name} on node {engine.node} is fed by rank {engine.feeder} on node {rank_node.get(engine.feeder)}"
                    " (CUDA IPC handles work within a node only)"
                )
            if r.engine_tp_size and engine.cuda_visible_devices is not None:
                problems.append(
                    f"{name} (colocated) sees CUDA_VISIBLE_DEVICES={engine.cuda_visible_devices!r}, not all of its "
                    "node's GPUs (its feeder's CUDA IPC shares name them)"
                )
        else:
            if on_rank_gpus:
                problems.append(f"{name} (separate) uses GPUs {on_rank_gpus} of actor ranks on node {engine.node}")
            seen = ",".join(map(str, engine.gpus))
            if r.engine_tp_size and engine.cuda_visible_devices != seen:
                problems.append(
                    f"{name} (separate) sees CUDA_VISIBLE_DEVICES={engine.cuda_visible_devices!r}, not its GPUs {seen!r}"
                )
    for (node, gpu), users in sorted(engine_gpus.items()):
        if len(users) > 1:
            problems.append(f"node {node} GPU {gpu} is used by engines {users}")
    return problems


def _gpu_span(gpus: list[int]) -> str:
    if not gpus:
        return "no GPU"
    if gpus == list(range(gpus[0], gpus[-1] + 1)) and len(gpus) > 1:
        return f"GPUs {gpus[0]}-{gpus[-1]}"
    return f"GPU{'s' if len(gpus) > 1 else ''} {','.join(map(str, gpus))}"


def rehearsed_traffic(rehearsal: Rehearsal, stage_bytes: list[int]) -> dict[int, tuple[int, int]]:
    """Bytes each node sends and receives over the network per weight sync, with the
    rehearsed ranks, nodes and feeders (``stage_bytes``: each stage's weights)."""
    from dapo_megatron.weight_sync.roles import sync_traffic

    ranks = sorted(rehearsal.ranks, key=lambda p: p.rank)
    feeders = {engine.feeder for engine in rehearsal.engines if engine.feeder is not None}
    return sync_traffic(
        feeders, [(p.rank, p.dp_rank, p.tp_rank, p.pp_rank) for p in ranks], [p.node for p in ranks], stage_bytes
    )


def format_rehearsal(rehearsal: Rehearsal, stage_bytes: Optional[list[int]] = None) -> str:
    """The per-node map and the checks' outcome, for the console; with ``stage_bytes``
    (each pipeline stage's weights as a sync sends them) each node's sync traffic."""
    r = rehearsal
    traffic = rehearsed_traffic(r, stage_bytes) if stage_bytes else {}
    lines = [
        f"Placement rehearsal on a simulated cluster of {len(r.node_ids)} node(s) x {r.gpus_per_node} GPU(s)"
        f" ({r.num_nodes} for the actor{f', {len(r.node_ids) - r.num_nodes} spare' if len(r.node_ids) > r.num_nodes else ''}):"
        f" {len(r.ranks)} rank(s), {len(r.engines)} engine(s) placed in {r.seconds:.1f} s",
    ]
    for node, node_id in enumerate(r.node_ids):
        ranks = sorted((p for p in r.ranks if p.node == node), key=lambda p: (p.gpus, p.rank))
        engines = [e for e in r.engines if e.node == node]
        role = "actor" if node < r.num_nodes else "spare"
        sync = ""
        if node in traffic:
            sent, received = traffic[node]
            sync = f"; weight sync sends {sent / 1e9:.1f} GB, receives {received / 1e9:.1f} GB"
        lines.append(f"  node {node} ({role}; Ray node {node_id[:8]}{sync})")
        if ranks:
            lines.append(
                "    ranks:   "
                + "  ".join(
                    f"{_gpu_span(p.gpus).replace('GPU ', 'GPU')}: r{p.rank} (tp{p.tp_rank} pp{p.pp_rank} dp{p.dp_rank})"
                    for p in ranks
                )
            )
        for engine in engines:
            feeder = f", fed by rank {engine.feeder}" if engine.feeder is not None else ""
            base = f" (base_gpu_id {engine.base_gpu_id})" if engine.base_gpu_id is not None else ""
            seen = engine.cuda_visible_devices if engine.cuda_visible_devices is not None else "all of the node's"
            lines.append(f"    engine {engine.index}: {_gpu_span(engine.gpus)}{base}, sees {seen}{feeder}")
    if r.problems:
        lines.append(f"Placement checks: {len(r.problems)} problem(s):")
        lines.extend(f"  - {problem}" for problem in r.problems)
    else:
        lines.append(
            "Placement checks passed: every actor GPU has exactly one rank, tensor-parallel groups stay inside a node, "
            "no two engines share a GPU"
            + (
                ", each colocated engine runs on its node's actor GPUs and is fed from its node"
                if r.colocate
                else ", separate engines use GPUs no rank uses"
            )
        )
    return "\n".join(lines)
