"""Where the actor's ranks and the rollout engines go: the decisions, without the processes.

Everything here is pure or asks only Ray's scheduler, and imports neither torch nor
megatron: ``train`` (:class:`ActorGroup`, :class:`RolloutWorkers`) and the placement
rehearsal (:mod:`dapo_megatron.rehearsal`, whose stand-in actors must start in a fraction
of a second each) place through the same functions, so what the rehearsal shows is what
``train`` asks Ray for.

- The actor: one bundle per node holding that node's ranks (a GPU and a CPU per rank on
  GPU runs), on distinct nodes; rank ``r`` in bundle ``r // devices_per_node``.
- Colocated GPU engines: inside the actor's placement group (Ray grants a group's GPUs
  only to tasks scheduled into it), spread evenly over its nodes, asking for no CPU or GPU
  and told their GPUs explicitly (:func:`colocated_engine_slots`).
- Separate GPU engines: ``engine_tp_size`` GPUs of their own, outside the group, seen
  through the ``CUDA_VISIBLE_DEVICES`` Ray sets (whatever their ids). So are ``eval``'s
  engines (no actor, no group): a GPU share each would let Ray's scheduler pack a
  node's worth of shares onto the head node (it fills the local node to half its GPUs
  first), where their whole GPUs do not fit; whole GPUs make Ray spread them.
- Each rank's (tp, cp, dp, pp) coordinates follow megatron-core's default rank order
  ``tp-cp-ep-dp-pp`` (:func:`rank_coordinates`).
"""

from __future__ import annotations

from typing import Optional

from dapo_megatron.config import Config, ParallelConfig

NOSET_CUDA_VISIBLE_DEVICES = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
"""A GPU engine's process sees all of its node's GPUs and is told which are its own."""


def engine_kind(config: Config) -> str:
    """``sglang`` or ``hf``: ``rollout.engine``, with ``auto`` meaning SGLang on a GPU."""
    if config.rollout.engine != "auto":
        return config.rollout.engine
    import torch

    return "sglang" if torch.cuda.is_available() and config.parallel.device != "cpu" else "hf"


def actor_on_gpu(parallel: ParallelConfig) -> bool:
    """Whether the actor's ranks each take a GPU (``device: cuda``, or ``auto`` with one)."""
    if parallel.device == "cuda":
        return True
    if parallel.device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


def actor_bundle(parallel: ParallelConfig, on_gpu: bool) -> dict[str, int]:
    """One node's share of the actor: a CPU (and a GPU on GPU runs) per rank on it."""
    per_node = parallel.num_devices_per_node
    return {"CPU": per_node, "GPU": per_node} if on_gpu else {"CPU": per_node}


def actor_placement_group(parallel: ParallelConfig, bundle: dict[str, int]):
    """The actor's placement group: one ``bundle`` per node, on distinct nodes (ranks
    r * devices_per_node ... (r + 1) * devices_per_node - 1 share node r, as megatron's
    process groups assume: tensor parallelism inside a node)."""
    from ray.util.placement_group import placement_group

    return placement_group(
        [dict(bundle) for _ in range(parallel.num_nodes)],
        strategy="STRICT_SPREAD" if parallel.num_nodes > 1 else "STRICT_PACK",
    )


def rank_options(parallel: ParallelConfig, placement_group, rank: int, on_gpu: bool) -> dict:
    """Ray options of actor rank ``rank``: one CPU (and GPU) of its node's bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    env = {"OMP_NUM_THREADS": "1"} if not on_gpu else {}
    return {
        "num_cpus": 1,
        "num_gpus": 1 if on_gpu else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=rank // parallel.num_devices_per_node
        ),
        "runtime_env": {"env_vars": env},
    }


def rank_coordinates(parallel: ParallelConfig, rank: int) -> dict[str, int]:
    """Global rank ``rank``'s tensor, context, data and pipeline coordinates, as
    megatron-core's ``initialize_model_parallel`` numbers them (order ``tp-cp-ep-dp-pp``,
    expert parallelism 1: tensor parallelism varies fastest, pipeline stages slowest)."""
    tp, cp = parallel.tp_size, parallel.cp_size
    dp = parallel.world_size // parallel.model_parallel_size
    return {
        "tp_rank": rank % tp,
        "cp_rank": (rank // tp) % cp,
        "dp_rank": (rank // (tp * cp)) % dp,
        "pp_rank": rank // (tp * cp * dp),
    }


def colocated_engine_slots(num_engines: int, tp_size: int, num_nodes: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """Colocated GPU engines: each engine's node (the bundle of the actor's placement
    group, one per node) and first GPU. Engines spread evenly over the nodes, in index
    order; a node's engines take consecutive ``tp_size`` GPUs from 0. ValueError when
    they cannot."""
    if num_engines % num_nodes:
        raise ValueError(
            f"rollout.num_engines={num_engines} colocated engines do not spread evenly over "
            f"parallel.num_nodes={num_nodes} nodes: use a multiple of {num_nodes}"
        )
    per_node = num_engines // num_nodes
    if per_node * tp_size > gpus_per_node:
        raise ValueError(
            f"{per_node} colocated engines of engine_tp_size={tp_size} per node need {per_node * tp_size} GPUs, "
            f"a node has {gpus_per_node} (parallel.num_devices_per_node): lower rollout.num_engines or engine_tp_size"
        )
    return [(index // per_node, (index % per_node) * tp_size) for index in range(num_engines)]


def engine_placements(config: Config, placement_group=None) -> list[tuple[dict, Optional[int]]]:
    """Each engine's Ray options and first GPU (None: decided at start, or none).

    Colocated GPU engines with the actor's ``placement_group`` live inside it: Ray grants
    a placement group's GPUs only to tasks scheduled into it, and the actor's ranks
    reserve every GPU of their nodes, so an engine asking for a GPU share outside the
    group would never start. They take no CPU or GPU of the bundle (the ranks hold them)
    and are given their GPUs explicitly (:func:`colocated_engine_slots`). Separate GPU
    engines, and colocated ones without a group (``eval``: no actor holds the GPUs),
    reserve ``engine_tp_size`` GPUs of their own and see only those; CPU engines a CPU."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    rollout = config.rollout
    if engine_kind(config) != "sglang":
        return [({"num_cpus": 1, "num_gpus": 0}, None) for _ in range(rollout.num_engines)]
    if not rollout.colocate or placement_group is None:  # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it reserved
        return [({"num_cpus": 1, "num_gpus": rollout.engine_tp_size}, None) for _ in range(rollout.num_engines)]
    parallel = config.parallel
    slots = colocated_engine_slots(
        rollout.num_engines, rollout.engine_tp_size, parallel.num_nodes, parallel.num_devices_per_node
    )
    return [
        (
            {
                "num_cpus": 0,
                "num_gpus": 0,
                "runtime_env": NOSET_CUDA_VISIBLE_DEVICES,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=node
                ),
            },
            base,
        )
        for node, base in slots
    ]


def engine_start_gpus(
    config: Config, base_gpu_id: Optional[int], reserved: list[int]
) -> tuple[Optional[int], list[int]]:
    """An engine's ``base_gpu_id`` (among the devices its process sees) and its GPUs (the
    node's ids), as it starts: colocated engines are given ``base_gpu_id`` and see every
    GPU of the node; a separate SGLang engine sees only the GPUs Ray ``reserved`` for it
    (any ids, consecutive or not: Ray sets ``CUDA_VISIBLE_DEVICES`` to them) and starts
    on the first it sees; the transformers engine has none."""
    tp = config.rollout.engine_tp_size
    if base_gpu_id is not None:
        return base_gpu_id, list(range(base_gpu_id, base_gpu_id + tp))
    if engine_kind(config) != "sglang":
        return None, []
    if len(reserved) != tp:
        raise ValueError(
            f"a separate rollout engine of engine_tp_size={tp} needs {tp} GPUs of its own; Ray reserved {sorted(reserved)}"
        )
    return 0, sorted(reserved)


def nccl_env_like_sglang(config: Config, environ) -> dict[str, str]:
    """NCCL settings an actor rank takes on so that it matches SGLang's processes in the
    weight-update communicator it shares with separate engines: SGLang 0.5.23
    (``entrypoints/engine.py``, ``_set_envs_and_config``) sets ``NCCL_CUMEM_ENABLE=0`` and
    ``NCCL_NVLS_ENABLE=0`` in its processes unless they are already set, and NCCL peers
    of one communicator must agree on cuMem. Empty for colocated or CPU engines, and for
    what the environment already sets (both sides then see the same value)."""
    if config.rollout.colocate or engine_kind(config) != "sglang":
        return {}
    return {key: "0" for key in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE") if key not in environ}


def choose_feeders(
    engine_places: list[tuple[str, list[int]]], rank_places: list[tuple[str, list[int]]], valid: set[int]
) -> dict[int, list[int]]:
    """The rank that feeds each colocated engine, from where engines and ranks are (Ray
    node, GPU ids): the lowest rank that may feed (a stage leader of the first replica or
    a rank of another replica) on one of the engine's own GPUs, so its workers map local
    memory; else the lowest on the engine's node (CUDA IPC works within a node); else
    rank 0. Engines on one node get different feeders when their GPUs differ, so they
    are fed in parallel."""
    plan: dict[int, list[int]] = {}
    for index, (node, gpus) in enumerate(engine_places):
        local = [rank for rank in sorted(valid) if rank_places[rank][0] == node]
        own = [rank for rank in local if set(rank_places[rank][1]) & set(gpus)]
        plan.setdefault((own or local or [0])[0], []).append(index)
    return plan
