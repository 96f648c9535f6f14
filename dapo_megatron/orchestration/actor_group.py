"""The Megatron actor as a group of Ray actors: one per rank, held by a placement group.

The driver never sees a rank. :class:`ActorGroup` reserves one bundle per rank (a GPU and
a CPU on GPU runs, a CPU on the CPU runtime), starts a :class:`ActorRank` in each, tells
every rank its rank, world size and rendezvous address (rank 0's node and a free port),
and each rank then brings up the existing runtime (NCCL on GPU, gloo on the CPU runtime)
and builds its :class:`MegatronActor`. Every public method calls the whole group and
returns one result: the log-probs reassembled from the data-parallel shards, the
metrics of rank 0 (equal on every rank), the sync's statistics.

Weight sync runs on the ranks: the first stage's leader (global rank 0) receives the
other stages' buckets as :func:`sync_weights` already does and feeds every engine at
once. Colocated engines get each bucket *by handle* (:mod:`handles`): packed once into a
reusable shareable buffer (CUDA IPC on GPU, shared memory on the CPU), the handle sent
to all engines, the next bucket packed while they copy; for SGLang's engines, whose TP
workers map the memory themselves, into a fresh staging tensor per bucket, serialized
once for each TP worker and freed once they have loaded it. Separate engines join a
weight-update group hosted by rank 0 and receive each announced bucket by broadcast
(NCCL on GPU, gloo on the CPU; :mod:`dapo_megatron.weight_sync.broadcast`). Either way
tensors never travel through Ray's object store.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Optional

import ray
import torch
from ray.util.placement_group import remove_placement_group

from dapo_megatron.actor.batch import PolicyBatch
from dapo_megatron.config import Config
from dapo_megatron.orchestration.cluster import separate_cpu_cores
from dapo_megatron.orchestration.group_calls import MemberFailed, call_all, cause_of, stop_all
from dapo_megatron.orchestration.placement import (
    actor_bundle,
    actor_on_gpu,
    actor_placement_group,
    choose_feeders,
    engine_kind,
    nccl_env_like_sglang,
    rank_options,
)
from dapo_megatron.weight_sync.bucket import SyncStats, WeightSyncError, with_last_flag
from dapo_megatron.weight_sync.gather import check_feeders, feeder_roles

logger = logging.getLogger(__name__)

_UPDATE_GROUP = "dapo_weight_update"


def _await_engines(refs: list, bound_s: float, names: Optional[list[str]] = None) -> list:
    """The engines' answers to one call of a weight update, each within ``bound_s``
    (``rollout.weight_sync_timeout_s``): a dead or hung engine is named, never waited for."""
    return call_all(refs, "a rollout engine", names, timeout_s=bound_s, timeout_key="rollout.weight_sync_timeout_s")


def _update_session(engines: list, what: str, stream, bound_s: float, names: Optional[list[str]] = None) -> SyncStats:
    """One weight update of every engine: open the session, ``stream()`` the buckets into
    them, close it, every call on an engine within ``bound_s``; on any failure abort it
    everywhere (as far as the engines answer) and raise WeightSyncError, naming the engine
    that died when the abort finds one (a rank feeding it only saw its connection close)."""
    _await_engines([engine.begin_weight_update.remote() for engine in engines], bound_s, names)
    try:
        stats = stream()
        _await_engines([engine.end_weight_update.remote() for engine in engines], bound_s, names)
    except Exception as exc:
        cause = str(cause_of(exc))
        try:
            _await_engines([engine.abort_weight_update.remote() for engine in engines], bound_s, names)
        except MemberFailed as abort_failed:  # a dead or hung engine cannot abort: it is the one to name
            cause = f"{abort_failed} (first seen as: {cause})"
        raise WeightSyncError(f"{what} into the rollout engines failed: {cause}") from exc
    return stats


def _stream_by_handle(
    buckets,
    buffers: list,
    engines: list,
    bound_s: float,
    names: Optional[list[str]] = None,
    keep=None,
    serialize=None,
    readers_per_engine: int = 1,
) -> tuple[int, int, int]:
    """Pack each bucket into the next of ``buffers`` and hand its handle to every engine
    without waiting for the previous one (an engine works through its calls in order, so
    it never idles between buckets); wait only before reusing a buffer, for the bucket
    packed into it last; ``keep(handle)`` sees every handle; ``serialize`` (SGLang's
    engines: ``serialize(flat, layout) -> bytes``) serializes each packed bucket, whole,
    for the engines' own workers, once for each of their ``readers_per_engine`` TP
    workers, and each engine gets only its own workers' payloads (every share is opened
    exactly once; the staging is freed once all have loaded it); every engine takes each
    bucket within ``bound_s``. Returns ``(bytes, tensors, buckets)`` sent."""
    in_flight: deque = deque()
    num_bytes = num_tensors = num_buckets = 0
    readers = len(engines) * readers_per_engine if serialize is not None else 1
    for index, (bucket, last) in enumerate(with_last_flag(buckets)):
        if len(in_flight) == len(buffers):
            _await_engines(in_flight.popleft(), bound_s, names)
        handle = buffers[index % len(buffers)].pack(bucket, serialize, readers)
        if keep is not None:
            keep(handle)
        if serialize is None:
            own = [handle] * len(engines)
        else:
            own = [handle.for_readers(i * readers_per_engine, readers_per_engine) for i in range(len(engines))]
        in_flight.append([engine.load_weight_bucket_handle.remote(h, last) for engine, h in zip(engines, own)])
        num_bytes += bucket.num_bytes
        num_tensors += len(bucket.tensors)
        num_buckets += 1
    while in_flight:
        _await_engines(in_flight.popleft(), bound_s, names)
    if serialize is not None:  # every bucket loaded: nothing shared is kept until the next sync
        for buffer in buffers:
            buffer.release_staging()
    return num_bytes, num_tensors, num_buckets


class _EngineFanout:
    """Looks like one engine to :func:`sync_weights`; feeds every engine by handle, in parallel."""

    def __init__(
        self,
        engines: list,
        names: Optional[list[str]],
        bound_s: float,
        buffers: list,
        serialize=None,
        readers_per_engine: int = 1,
    ) -> None:
        self.engines, self.names, self.bound_s = engines, names, bound_s
        self.buffers = buffers  # two SharedBucketBuffers, kept by the rank across syncs
        self.serialize = serialize
        self.readers_per_engine = readers_per_engine

    def update_weights(self, buckets) -> SyncStats:
        start = time.perf_counter()

        def stream() -> SyncStats:
            sent = _stream_by_handle(
                buckets,
                self.buffers,
                self.engines,
                self.bound_s,
                self.names,
                serialize=self.serialize,
                readers_per_engine=self.readers_per_engine,
            )
            return SyncStats(time.perf_counter() - start, *sent)

        return _update_session(self.engines, "weight sync", stream, self.bound_s, self.names)


class _Waiter:
    """What ``broadcast_buckets`` waits on after broadcasting a bucket: the engines' receives."""

    def __init__(self, refs: list, bound_s: float, names: Optional[list[str]]) -> None:
        self.refs, self.bound_s, self.names = refs, bound_s, names

    def wait(self) -> None:
        _await_engines(self.refs, self.bound_s, self.names)


class _BroadcastFanout:
    """Looks like one engine to :func:`sync_weights`; broadcasts every bucket over the
    weight-update group to all (separate) engines at once."""

    def __init__(
        self, engines: list, names: Optional[list[str]], bound_s: float, group, group_name: str, device: torch.device
    ) -> None:
        self.engines, self.names, self.bound_s = engines, names, bound_s
        self.group, self.group_name, self.device = group, group_name, device

    def update_weights(self, buckets) -> SyncStats:
        from dapo_megatron.weight_sync.broadcast import broadcast_buckets

        def announce(names, dtypes, shapes, last):
            return _Waiter(
                [e.receive_broadcast_bucket.remote(names, dtypes, shapes, self.group_name, last) for e in self.engines],
                self.bound_s,
                self.names,
            )

        return _update_session(
            self.engines,
            "weight broadcast",
            lambda: broadcast_buckets(buckets, self.group, announce, device=self.device),
            self.bound_s,
            self.names,
        )


@ray.remote
class ActorRank:
    """One rank of the Megatron actor, in its own process (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.actor = None
        self.info = None
        self._buffers: list = []
        self._piece_handles: Optional[tuple] = None  # (key, handles, sent) of the last piece sync
        self._update_group = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address as Ray knows it (127.0.0.1 on a local instance) and a free
        port on it (asked of rank 0): the rendezvous store listens there and nowhere else."""
        from dapo_megatron.runtime.distributed import find_free_port

        address = ray.util.get_node_ip_address()
        return address, find_free_port(address)

    def setup(
        self, rank: int, world_size: int, master_addr: str, master_port: int, cores: Optional[list[int]] = None
    ) -> dict:
        """Bring up the runtime and build the actor; returns this rank's RuntimeInfo as a dict."""
        from dapo_megatron.actor.megatron_actor import MegatronActor
        from dapo_megatron.runtime.distributed import initialize_runtime
        from dapo_megatron.weight_sync.handles import share_storage, use_shareable_cpu_tensors

        cfg = self.config
        if cores:
            from dapo_megatron.orchestration.cluster import pin_process

            pin_process(cores)  # before gloo and OpenMP start their threads
        threads = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
        torch.set_num_threads(threads)
        # With Ray's GPU isolation every rank sees its one GPU as device 0.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK="0" if torch.cuda.is_available() and cfg.parallel.device != "cpu" else str(rank),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        use_shareable_cpu_tensors()
        if torch.cuda.is_available() and cfg.parallel.device != "cpu":
            os.environ.update(nccl_env_like_sglang(cfg, os.environ))  # before NCCL reads it
        self.info = initialize_runtime(cfg.parallel, cfg.trainer.seed)
        self.actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, self.info)
        if self.info.is_cpu and cfg.rollout.colocate:
            # Weight sync then references the parameters instead of copying them.
            for param in self.actor.gpt.parameters():
                share_storage(param)
        info = asdict(self.info)
        info["device"] = str(info["device"])
        info["pid"] = os.getpid()
        return info

    def load_weights(self, source: str, path: str) -> None:
        """Initial weights: ``source`` is ``megatron`` (a dist checkpoint) or ``hf`` (safetensors)."""
        from dapo_megatron.actor.checkpoint import load_hf_model_weights, load_model_weights

        if source == "megatron":
            load_model_weights(self.actor, path)
        elif source == "hf":
            load_hf_model_weights(self.actor, path)
        else:
            raise ValueError(f"unknown weight source {source!r}")

    def load_reference(self, source: str, path: str) -> None:
        """The KL penalty's reference policy (``megatron`` checkpoint or ``hf`` folder)."""
        from dapo_megatron.actor.checkpoint import load_reference_weights

        load_reference_weights(self.actor, source, path)

    def compute_log_probs(
        self,
        batch: PolicyBatch,
        temperature: float,
        num_mini_batches: int = 1,
        reference: bool = False,
        routing: Optional[tuple] = None,
    ):
        """This data-parallel rank's rows and their log-probs and entropies (reported by one
        rank per data-parallel replica; None from the others). The rows are the share
        :meth:`train` gets with the same ``num_mini_batches``, in the same micro-batches.
        ``routing``: those rows' routing records, sent apart (:meth:`ActorGroup._put`)."""
        rows, shard = self._share(batch, num_mini_batches, routing)
        log_probs, entropy = self.actor.compute_log_probs(shard.trimmed(), temperature, num_mini_batches, reference)
        if self.info.tp_rank == 0 and self.info.pp_rank == 0:
            return rows, log_probs, entropy
        return None

    def train(
        self, batch: PolicyBatch, num_mini_batches: int, temperature: float, routing: Optional[tuple] = None
    ) -> list[dict]:
        """DAPO updates on this rank's share of ``batch``; metrics are equal on every rank."""
        _, shard = self._share(batch, num_mini_batches, routing)
        return self.actor.train(shard, num_mini_batches, temperature)

    def _share(self, batch: PolicyBatch, num_mini_batches: int, routing: Optional[tuple]):
        """This data-parallel rank's rows of ``batch`` and the batch of them, with their
        routing records when they came apart."""
        from dapo_megatron.actor.batch import data_parallel_rows

        rows = data_parallel_rows(batch, self.info.dp_rank, self.actor.dp_group.size(), num_mini_batches)
        shard = batch.select(rows)
        if routing is not None:
            shard.routed_experts, shard.routed_lengths = routing
        return rows, shard

    def save(
        self,
        save_dir: str,
        keep_last: int,
        extra_files: Optional[dict[str, str]] = None,
        moved_files: Optional[dict[str, str]] = None,
    ) -> str:
        """A dist checkpoint of model, optimizer, scheduler, RNG and step (and ``extra_files``
        and ``moved_files``, see :func:`save_checkpoint`)."""
        from dapo_megatron.actor.checkpoint import save_checkpoint

        return str(save_checkpoint(self.actor, save_dir, keep_last, extra_files, moved_files))

    def load_checkpoint(self, path: str, seed: int) -> int:
        """Restore model, optimizer, scheduler, step and RNG from a checkpoint; the step."""
        from dapo_megatron.actor.checkpoint import load_checkpoint

        return load_checkpoint(self.actor, path, seed=seed)

    def matmul_flops_per_s(self, shapes: list[tuple[int, int]], tokens: int, repeats: int) -> float:
        """FLOP/s of plain matmuls at ``shapes`` in this rank's parameter dtype, on its
        device (the benchmark's compute ceiling)."""
        from dapo_megatron.runtime.measure import matmul_flops_per_s

        dtype = next(self.actor.gpt.parameters()).dtype
        return matmul_flops_per_s(shapes, tokens, dtype, self.actor.device, repeats)

    def free_cached_memory(self) -> None:
        """Hand the CUDA caching allocator's unused blocks back to the driver (no-op on
        the CPU), so that colocated engines resuming their memory find it free."""
        if self.actor.device.type == "cuda":
            torch.cuda.empty_cache()

    def peak_memory(self, reset: bool) -> int:
        """This rank's peak memory since the last reset (then reset it, if ``reset``)."""
        from dapo_megatron.runtime.measure import take_peak_memory

        return take_peak_memory(self.actor.device, reset)

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        return ray.get_runtime_context().get_node_id()

    def placement(self) -> tuple[str, list[int]]:
        """The Ray node this rank runs on and the GPU Ray gave it (none on the CPU)."""
        return self.node_id(), [int(i) for i in ray.get_gpu_ids()]

    def sync_weights(
        self,
        engines: list,
        bucket_bytes: int,
        engine_ranks: int,
        feeders: tuple[int, ...],
        names: Optional[list[str]] = None,
    ) -> Optional[dict]:
        """Collective: stream the weights into the engines. ``engines`` are the ones this
        rank feeds (empty unless it is in ``feeders``; ``names``, theirs for errors): by
        handle when they are colocated, by broadcast over a weight-update group hosted by
        rank 0 when they are not."""
        from dapo_megatron.weight_sync.gather import sync_weights
        from dapo_megatron.weight_sync.handles import SharedBucketBuffer, share_storage

        fanout = None
        if engines and self.config.rollout.colocate:
            if not self._buffers:
                self._buffers = [SharedBucketBuffer(self.actor.device) for _ in range(2)]
            serialize = None
            if engine_kind(self.config) == "sglang":
                from dapo_megatron.rollout.sglang_engine import sglang_bucket_payload as serialize
            fanout = _EngineFanout(
                engines, names, self._sync_bound_s, self._buffers, serialize, self.config.rollout.engine_tp_size
            )
        elif engines:
            if self._update_group is None:
                self._update_group = self._host_update_group(engines, engine_ranks)
            fanout = _BroadcastFanout(
                engines, names, self._sync_bound_s, self._update_group, _UPDATE_GROUP, self.actor.device
            )
        stats = sync_weights(self.actor, fanout, bucket_bytes, feeders)
        if engines and self.config.rollout.colocate and self.info.is_cpu:
            # The q/k/v export buffers persist across syncs: reference them from the next one.
            for buffer in self.actor.hf_export_buffers.values():
                share_storage(buffer)
        return asdict(stats) if stats is not None else None

    @property
    def _sync_bound_s(self) -> float:
        return self.config.rollout.weight_sync_bound_s

    def feed_pieces(self, engines: list, bucket_bytes: int, names: Optional[list[str]] = None) -> dict:
        """Send this rank's own shards, as pieces by handle, to every engine of an open
        weight-update session (:func:`iter_piece_buckets`: no collective, no copy here).
        Returns the bytes, tensors and buckets sent.

        Pieces are views of the parameters, which live in shared memory and keep their
        storage from step to step: their handles are the same every sync, so they are made
        once and resent as they are while the parameters' storage is unchanged."""
        from dapo_megatron.weight_sync.gather import iter_piece_buckets
        from dapo_megatron.weight_sync.handles import SharedBucketBuffer

        key = (bucket_bytes, tuple(p.untyped_storage().data_ptr() for p in self.actor.gpt.parameters()))
        if self._piece_handles is not None and self._piece_handles[0] == key:
            _, handles, sent = self._piece_handles
            for handle in handles:
                refs = [engine.load_weight_bucket_handle.remote(handle, False) for engine in engines]
                _await_engines(refs, self._sync_bound_s, names)
            return sent
        if not self._buffers:
            self._buffers = [SharedBucketBuffer(self.actor.device) for _ in range(2)]
        handles: list = []
        references_only = True

        def buckets():
            nonlocal references_only
            for bucket in iter_piece_buckets(self.actor, bucket_bytes):
                references_only &= all(t.is_shared() and t.is_contiguous() for _, t in bucket.tensors)
                yield bucket

        sent = dict(
            zip(
                ("num_bytes", "num_tensors", "num_buckets"),
                _stream_by_handle(buckets(), self._buffers, engines, self._sync_bound_s, names, handles.append),
            )
        )
        # A staged piece's bytes change every sync: only handles of references are reused.
        self._piece_handles = (key, handles, sent) if references_only and self.info.is_cpu else None
        return sent

    def _host_update_group(self, engines: list, engine_ranks: int):
        """Rank 0 of a new weight-update group; every engine joins with its offset."""
        from dapo_megatron.runtime.distributed import find_free_port
        from dapo_megatron.weight_sync.update_group import init_weight_update_group

        address = ray.util.get_node_ip_address()  # the store listens on this address only
        port = find_free_port(address)
        world_size = 1 + len(engines) * engine_ranks
        joins = [
            engine.join_weight_update_group.remote(address, port, 1 + i * engine_ranks, world_size, _UPDATE_GROUP)
            for i, engine in enumerate(engines)
        ]
        backend = "nccl" if self.actor.device.type == "cuda" else "gloo"
        group = init_weight_update_group(address, port, 0, world_size, _UPDATE_GROUP, backend=backend)
        _await_engines(joins, self._sync_bound_s)
        return group

    def export_hf_weights(self) -> Optional[dict]:
        """The full model in HF names, by value, on rank 0 (tests of small models only)."""
        from dapo_megatron.weight_sync.gather import iter_weight_buckets

        if self.actor.parallel.pp_size != 1:
            raise NotImplementedError("export_hf_weights is for pp_size=1 test models")
        tensors = {}
        for bucket in iter_weight_buckets(self.actor):
            tensors.update({name: t.clone() for name, t in bucket.tensors})
        return tensors if self.info.rank == 0 else None

    def shutdown(self) -> None:
        """Free the shared buffers and tear the runtime down."""
        from dapo_megatron.runtime.distributed import shutdown_runtime

        for buffer in self._buffers:
            buffer.close()
        self._buffers = []
        self._piece_handles = None
        self.actor = None
        gc.collect()
        if self.info is not None:
            shutdown_runtime()
            self.info = None


PLACEMENT_TIMEOUT_S = 300.0
"""How long the actor's placement may wait for resources before the run fails clearly."""


def _refuse_what_cannot_be_placed(config: Config, bundle: dict[str, int]) -> None:
    """Fail at once, naming what was asked and what the cluster has, when the actor's
    per-node bundle cannot be placed: a GPU layout on a cluster without GPUs, or a local
    instance (whose resources are fixed: no node will join) without enough nodes that
    hold a bundle. A joined cluster may still be growing: there the wait is bounded by
    :data:`PLACEMENT_TIMEOUT_S`, and a warning says what it waits for."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    have = {key: sum(node.get(key, 0) for node in nodes) for key in bundle}
    if bundle.get("GPU") and not have["GPU"]:
        raise RuntimeError(
            f"parallel.device=cuda, but the Ray cluster has no GPUs ({len(nodes)} node(s): "
            f"{', '.join(f'{have[key]:g} {key}' for key in bundle)}); run on GPU nodes, or set parallel.device=cpu"
        )
    fitting = sum(all(node.get(key, 0) >= amount for key, amount in bundle.items()) for node in nodes)
    wanted = config.parallel.num_nodes
    if fitting >= wanted:
        return
    asked = f"{wanted} node(s) with {bundle} each (parallel.num_nodes x parallel.num_devices_per_node)"
    found = f"the cluster has {fitting} such node(s) of {len(nodes)} ({', '.join(f'{have[k]:g} {k}' for k in bundle)})"
    if config.ray.address is None:
        raise RuntimeError(
            f"the actor needs {asked}, and {found}; this local Ray instance will not grow (ray.num_cpus sets its "
            "CPUs): reduce the layout or join a larger cluster with ray.address"
        )
    logger.warning(
        "the actor needs %s, and %s: waiting up to %.0f s for nodes to join", asked, found, PLACEMENT_TIMEOUT_S
    )


class ActorGroup:
    """All ranks of the actor, called as one (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        while_ranks_start: Optional[Callable[[ActorGroup], None]] = None,
        rank_actor=None,
        schedule_timeout_s: Optional[float] = None,
    ) -> None:
        """Place the ranks, start them and set up megatron in each. ``while_ranks_start``
        is called with the group once the ranks' processes have been asked for, before
        waiting for them (the engines' processes then start alongside instead of after
        them, colocated GPU engines inside the group's :attr:`placement_group`).
        ``rank_actor``: the Ray actor class of a rank (:class:`ActorRank`; the placement
        rehearsal's stand-ins). Ranks Ray has not started fail the start, named, once none
        has started for ``schedule_timeout_s`` (default :data:`SCHEDULE_TIMEOUT_S`)."""
        self.config = config
        parallel = config.parallel
        self.world_size = parallel.world_size
        on_gpu = actor_on_gpu(parallel)
        bundle = actor_bundle(parallel, on_gpu)
        _refuse_what_cannot_be_placed(config, bundle)
        logger.info("placing the actor's %d rank(s): %d node(s) x %s", self.world_size, parallel.num_nodes, bundle)
        self.placement_group = actor_placement_group(parallel, bundle)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"the actor's {parallel.num_nodes} node(s) x {bundle} could not be placed within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()} on "
                f"{len([n for n in ray.nodes() if n['Alive']])} node(s) (parallel.num_nodes must not exceed them)"
            )
        rank_actor = ActorRank if rank_actor is None else rank_actor
        self.ranks = [
            rank_actor.options(**rank_options(parallel, self.placement_group, rank, on_gpu)).remote(config)
            for rank in range(self.world_size)
        ]
        if while_ranks_start is not None:
            try:
                while_ranks_start(self)
            except BaseException:  # nobody holds this group yet to shut it down
                for rank in self.ranks:
                    ray.kill(rank)
                remove_placement_group(self.placement_group)
                raise
        self._rank_places_cache: Optional[list[tuple[str, list[int]]]] = None
        self._engine_places: dict[tuple, list[tuple[str, list[int]]]] = {}
        self.names = [f"actor rank {rank}" for rank in range(self.world_size)]
        # Every rank started, boundedly (a rank Ray cannot place is named, not waited for).
        call_all(
            [r.node_id.remote() for r in self.ranks],
            "an actor rank",
            self.names,
            members=self.ranks,
            asked="1 CPU" + (", 1 GPU" if on_gpu else "") + " of its node's bundle",
            schedule_timeout_s=schedule_timeout_s,
        )
        master_addr, master_port = ray.get(self.ranks[0].rendezvous_address.remote())
        separate = separate_cpu_cores(config)  # ranks on cores of their own (async generation)
        rank_cores = separate[0] if separate else [None] * self.world_size
        self.infos = call_all(
            [
                r.setup.remote(rank, self.world_size, master_addr, master_port, rank_cores[rank])
                for rank, r in enumerate(self.ranks)
            ],
            "an actor rank",
            self.names,
        )
        self.names = [
            f"actor rank {i['rank']} (tp {i['tp_rank']}, pp {i['pp_rank']}, dp {i['dp_rank']}; pid {i['pid']})"
            for i in self.infos
        ]
        _, self.valid_feeders = feeder_roles(
            [(i["rank"], i["dp_rank"], i["tp_rank"], i["pp_rank"]) for i in self.infos]
        )
        self._feeder_plans: dict[tuple, dict[int, list[int]]] = {}
        logger.info(
            "actor up: %d ranks (tp %d, pp %d, dp %d%s)",
            self.world_size,
            parallel.tp_size,
            parallel.pp_size,
            self.world_size // parallel.model_parallel_size,
            f", experts over ep {parallel.ep_size}" if parallel.ep_size > 1 else "",
        )

    def load_weights(self, source: str, path: str) -> None:
        """Initial weights on every rank (``megatron`` checkpoint or ``hf`` folder)."""
        call_all([r.load_weights.remote(source, path) for r in self.ranks], "an actor rank", self.names)

    def load_reference(self, source: str, path: str) -> None:
        """The KL penalty's reference policy on every rank (``megatron`` checkpoint or ``hf`` folder)."""
        call_all([r.load_reference.remote(source, path) for r in self.ranks], "an actor rank", self.names)

    def compute_log_probs(
        self, batch: PolicyBatch, temperature: float, num_mini_batches: int = 1, reference: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, seq]`` log-probs and entropies of the loss tokens, reassembled; computed
        in the micro-batches of :meth:`train` with the same ``num_mini_batches``; under the
        KL penalty's reference policy with ``reference``."""
        ref, routing = self._put(batch, num_mini_batches)
        parts = call_all(
            [
                r.compute_log_probs.remote(ref, temperature, num_mini_batches, reference, routing[i])
                for i, r in enumerate(self.ranks)
            ],
            "an actor rank",
            self.names,
        )
        log_probs = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        entropy = torch.zeros_like(log_probs)
        for part in parts:
            if part is None:
                continue
            rows, lp, ent = part
            width = lp.shape[1]
            log_probs[rows, :width] = lp
            entropy[rows, :width] = ent
        return log_probs, entropy

    def train(self, batch: PolicyBatch, num_mini_batches: int, temperature: float) -> list[dict[str, float]]:
        """One rollout step of DAPO updates; each update's metrics."""
        ref, routing = self._put(batch, num_mini_batches)
        return call_all(
            [r.train.remote(ref, num_mini_batches, temperature, routing[i]) for i, r in enumerate(self.ranks)],
            "an actor rank",
            self.names,
        )[0]

    def _put(self, batch: PolicyBatch, num_mini_batches: int) -> tuple:
        """``batch`` in Ray's object store for every rank, and for each rank the routing
        records of its data-parallel replica's rows apart (None without records): records
        are ``moe_layers x k`` bytes a token, the bulk of a batch, and a rank needs only its
        replica's share."""
        if batch.routed_experts is None:
            return ray.put(batch), [None] * len(self.ranks)
        from dataclasses import replace

        from dapo_megatron.actor.batch import data_parallel_rows

        dp_size = max(info["dp_rank"] for info in self.infos) + 1
        by_replica = {}
        for dp_rank in range(dp_size):
            rows = data_parallel_rows(batch, dp_rank, dp_size, num_mini_batches)
            by_replica[dp_rank] = ray.put((batch.routed_experts[rows], batch.routed_lengths[rows]))
        light = replace(batch, routed_experts=None, routed_lengths=None)
        return ray.put(light), [by_replica[info["dp_rank"]] for info in self.infos]

    def save(
        self,
        save_dir: str,
        keep_last: int,
        extra_files: Optional[dict[str, str]] = None,
        moved_files: Optional[dict[str, str]] = None,
    ) -> str:
        """Checkpoint folder written (with ``extra_files`` in it, name -> text, and
        ``moved_files``, name -> path of a file on the checkpoint's file system)."""
        return call_all(
            [r.save.remote(save_dir, keep_last, extra_files, moved_files) for r in self.ranks],
            "an actor rank",
            self.names,
        )[0]

    def load_checkpoint(self, path: str, seed: int) -> int:
        """Every rank restores its full state (any tp/pp layout) from ``path``; the step."""
        return call_all([r.load_checkpoint.remote(path, seed) for r in self.ranks], "an actor rank", self.names)[0]

    def sync_weights(
        self,
        engines: list,
        bucket_bytes: int,
        engine_ranks: int = 1,
        feeders: Optional[dict[int, list[int]]] = None,
        names: Optional[list[str]] = None,
    ) -> SyncStats:
        """Push the current weights into every engine (Ray actor handles, ``names`` theirs
        for errors; ``engine_ranks`` is each engine's rank count in a weight-update group).
        Every call on an engine is bounded by ``rollout.weight_sync_timeout_s``.

        ``feeders`` maps a rank to the indices of the engines it feeds; by default each
        engine is fed by a rank on its own node (:meth:`plan_feeders`). Separate engines
        are all fed by rank 0, which hosts their weight-update group.
        """
        if feeders is None and self._feeds_pieces(engines):
            return self._sync_by_pieces(engines, bucket_bytes, names)
        if feeders is None:
            feeders = self.plan_feeders(engines) if self.config.rollout.colocate else {0: list(range(len(engines)))}
        # Checked here, before any rank acts: a rank wrongly made a feeder of separate
        # engines would otherwise start hosting a weight-update group.
        check_feeders(feeders, self.valid_feeders)
        if not self.config.rollout.colocate and set(feeders) != {0}:
            raise ValueError("separate engines (rollout.colocate=false) are fed by rank 0, which hosts their group")
        ranks = tuple(sorted(feeders))
        results = call_all(
            [
                r.sync_weights.remote(
                    [engines[i] for i in feeders.get(rank, [])],
                    bucket_bytes,
                    engine_ranks,
                    ranks,
                    [names[i] for i in feeders.get(rank, [])] if names else None,
                )
                for rank, r in enumerate(self.ranks)
            ],
            "an actor rank",
            self.names,
        )
        done = [SyncStats(**result) for result in results if result is not None]
        return SyncStats(
            max(s.seconds for s in done),
            sum(s.num_bytes for s in done),
            sum(s.num_tensors for s in done),
            sum(s.num_buckets for s in done),
        )

    def _feeds_pieces(self, engines: list) -> bool:
        """Whether every rank of the first replica can feed every engine its own shards:
        colocated transformers engines on the CPU runtime, all on the ranks' one node
        (handles name shared memory, which only that node can map). Asked of Ray once per
        set of engines."""
        if not (self.config.rollout.colocate and self.infos[0]["device"] == "cpu" and engine_kind(self.config) == "hf"):
            return False
        nodes = self._nodes_of(engines)
        return len(set(self._rank_nodes()) | set(nodes)) == 1

    def _rank_places(self) -> list[tuple[str, list[int]]]:
        """Each rank's Ray node and GPUs (asked once: placement does not change during a run)."""
        if self._rank_places_cache is None:
            self._rank_places_cache = call_all([r.placement.remote() for r in self.ranks], "an actor rank", self.names)
        return self._rank_places_cache

    def _rank_nodes(self) -> list[str]:
        return [node for node, _ in self._rank_places()]

    def _places_of(self, engines: list) -> list[tuple[str, list[int]]]:
        """Each engine's Ray node and GPUs, asked once per set of engines."""
        key = tuple(engines)
        if key not in self._engine_places:
            self._engine_places[key] = call_all([engine.placement.remote() for engine in engines], "a rollout engine")
        return self._engine_places[key]

    def _nodes_of(self, engines: list) -> list[str]:
        return [node for node, _ in self._places_of(engines)]

    def _sync_by_pieces(self, engines: list, bucket_bytes: int, names: Optional[list[str]]) -> SyncStats:
        """Every first-replica rank (and every first holder of some experts) sends its own
        shards to every engine, all at once,
        inside one update session per engine (see :meth:`ActorRank.feed_pieces`)."""
        start = time.perf_counter()
        # The first replica, and the ranks outside it that are the first to hold some experts.
        senders = [i for i, info in enumerate(self.infos) if info["dp_rank"] == 0 or info["expert_dp_rank"] == 0]

        def stream() -> SyncStats:
            sent = call_all(
                [self.ranks[i].feed_pieces.remote(engines, bucket_bytes, names) for i in senders],
                "an actor rank",
                [self.names[i] for i in senders],
            )
            return SyncStats(
                time.perf_counter() - start,
                *(sum(s[key] for s in sent) for key in ("num_bytes", "num_tensors", "num_buckets")),
            )

        return _update_session(engines, "weight sync", stream, self.config.rollout.weight_sync_bound_s, names)

    def plan_feeders(self, engines: list) -> dict[int, list[int]]:
        """Each engine's feeder (see :func:`choose_feeders`), asked of Ray once per set
        of engines (placement does not change during a run)."""
        key = tuple(engines)
        if key not in self._feeder_plans:
            self._feeder_plans[key] = choose_feeders(self._places_of(engines), self._rank_places(), self.valid_feeders)
        return self._feeder_plans[key]

    def matmul_flops_per_s(self, shapes: list[tuple[int, int]], tokens: int, repeats: int = 3) -> list[float]:
        """Each rank's plain-matmul FLOP/s at ``shapes``, all ranks measuring at once."""
        return call_all(
            [r.matmul_flops_per_s.remote(shapes, tokens, repeats) for r in self.ranks], "an actor rank", self.names
        )

    def peak_memory(self, reset: bool = False) -> list[int]:
        """Each rank's peak memory (bytes) since its last reset; ``reset`` starts a new one."""
        return call_all([r.peak_memory.remote(reset) for r in self.ranks], "an actor rank", self.names)

    def free_cached_memory(self) -> None:
        """Every rank returns its allocator's cached, unused GPU memory (before colocated
        engines take theirs back)."""
        call_all([r.free_cached_memory.remote() for r in self.ranks], "an actor rank", self.names)

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """The full model in HF names (tests of small models)."""
        return call_all([r.export_hf_weights.remote() for r in self.ranks], "an actor rank", self.names)[0]

    def shutdown(self) -> None:
        """Tear the ranks down and free their placement group."""
        from dapo_megatron.weight_sync.handles import remove_shared_files_of

        stop_all(self.ranks, "actor")
        remove_placement_group(self.placement_group)
        # Ray killed the ranks: remove the shared memory they created (weight sync).
        remove_shared_files_of([info["pid"] for info in self.infos])

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("ActorGroup lives on the driver; pass its methods' results, not the group")
