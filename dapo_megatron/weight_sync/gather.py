"""Stream the actor's weights to a rollout engine as buckets of HF-named tensors.

After every training step the rollout engines need the new weights, in HF names and
layouts. Megatron holds them split three ways: tensor-parallel shards, pipeline stages,
and (for the checkpoint-side layout) fused QKV and gate/up. This module walks the model
on every rank of each data-parallel replica that feeds an engine:

- each tensor-parallel shard is gathered onto the stage's tensor-parallel rank 0 (the
  *stage leader*), one parameter at a time; SwiGLU ``linear_fc1`` shards are
  ``[gate_r; up_r]`` and are regrouped into ``[gate; up]``;
- the leader converts the full parameter with :mod:`dapo_megatron.ckpt.mapping`
  (the converter's mapping; vocabulary padding stripped) under its *global* layer index
  and packs the results into buckets of ``bucket_bytes``;
- every stage leader sends its buckets to the *feeders* of its own data-parallel replica,
  the stage leaders that hold an engine handle (by default global rank 0; the
  orchestration picks a rank on each engine's node), and each feeder hands its engine all
  stages' buckets, in model order, as they arrive (``engine.update_weights``). Every
  replica holds the whole model, so each replica that feeds gathers its own stages and
  nothing travels between replicas: a rank sends at most its own stage to each other
  feeder of its replica.

Experts (mixture-of-experts families) are split a fourth way, over the expert-parallel
group, which may span data-parallel replicas: each layer's local experts are all-gathered
over that group (every rank of it takes part, fed replica or not) and sent under each
expert's HF names (``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``).

No rank ever holds more than one parameter's full tensor (a layer's experts count as
one) plus one bucket, never the whole model. Unsharded parameters travel as views of the live weights (no copy); the
engine copies what it receives before the sync returns, and training does not resume
until then.

Engines that accept *pieces* (``accepts_pieces``: the transformers engine) can instead be
fed by every rank of the first replica directly (:func:`iter_piece_buckets`): each rank
sends views of its own shards with their place in the HF tensor
(:func:`~dapo_megatron.ckpt.mapping.shard_to_hf_pieces`), so nothing is gathered,
rearranged or relayed between stages, and the engine's copy is the only one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist

from dapo_megatron.ckpt.mapping import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT_LAYER,
    ModelShape,
    canonical_layer_param,
    expert_to_hf,
    layer_params,
    megatron_layer_key,
    shard_to_hf_pieces,
    to_hf,
)
from dapo_megatron.models.gpt import local_expert_of
from dapo_megatron.weight_sync.bucket import SyncStats, WeightBucket, WeightSink, WeightSyncError
from dapo_megatron.weight_sync.roles import SyncRoles, check_feeders, feeder_roles, sync_roles

__all__ = ["check_feeders", "feeder_roles", "sync_weights"]

DEFAULT_BUCKET_BYTES = 512 * 2**20


def _gather_to_leader(param: torch.Tensor, name: str, tp_group, leader: bool) -> Optional[torch.Tensor]:
    """The full (TP-unsharded) parameter on the stage leader (a view when it is not
    sharded); None elsewhere."""
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    data = param.detach()
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return data if leader else None
    dim = param.partition_dim
    shards = [torch.empty_like(data) for _ in range(tp_size)] if leader else None
    dist.gather(data.contiguous(), shards, dst=dist.get_global_rank(tp_group, 0), group=tp_group)
    if not leader:
        return None
    if name.endswith("linear_fc1.weight"):
        # Each shard is [gate_r; up_r]: regroup into [gate_0 .. gate_n; up_0 .. up_n].
        halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def _gather_experts(local: list[torch.Tensor], ep_group) -> torch.Tensor:
    """A layer's experts ``[num_experts, ...]`` from every expert-parallel rank's local ones
    (on every rank of the group: the group may span replicas, so all of it takes part)."""
    stacked = torch.stack([p.detach() for p in local])
    ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    if ep_size == 1:
        return stacked
    parts = [torch.empty_like(stacked) for _ in range(ep_size)]
    dist.all_gather(parts, stacked, group=ep_group)
    return torch.cat(parts)


def iter_hf_tensors(actor) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's weights as ``(hf_name, tensor)``, on its leader only.

    Must be run by every tensor-parallel rank of the stage and, for a model with experts,
    by every rank of its expert-parallel group (the gathers are collective); non-leaders
    yield nothing.
    """
    shape = ModelShape.from_model_config(actor.model_config)
    tp_group = actor.tp_group
    leader = actor.runtime.tp_rank == 0
    params = dict(actor.gpt.named_parameters())

    # q/k/v are rearranged on every sync: reuse the same export buffers each time rather
    # than faulting in fresh memory (the engine copies them before the sync returns).
    buffers = actor.hf_export_buffers

    for megatron_key, param_names, layer in _stage_params_in_order(actor):
        if isinstance(param_names, tuple):  # a layer's local experts
            full = _gather_experts([params[n] for n in param_names], actor.ep_group)
            if leader:
                yield from expert_to_hf(megatron_key, full, layer, range(full.shape[0])).items()
            continue
        full = _gather_to_leader(params[param_names], megatron_key, tp_group, leader)
        if leader:
            yield from to_hf(megatron_key, full, shape, layer, buffers).items()


def _stage_params_in_order(actor) -> list[tuple[str, str | tuple[str, ...], Optional[int]]]:
    """This pipeline stage's parameters in model order as ``(megatron_key, parameter
    name, global layer index or None)``: embedding, layers, final norm, output layer. A
    layer's local experts come as one entry per expert tensor, with the names of all of
    them in local order."""
    gpt = actor.gpt
    shape = ModelShape.from_model_config(actor.model_config)
    params = [name for name, _ in gpt.named_parameters()]
    order: list[tuple[str, str | tuple[str, ...], Optional[int]]] = []
    if gpt.pre_process:
        order.append((EMBEDDING, "embedding.word_embeddings.weight", None))
    for local_index, layer in enumerate(gpt.decoder.layers):
        prefix = f"decoder.layers.{local_index}."
        experts: dict[str, dict[int, str]] = {}
        mapped = layer_params(shape, layer.layer_number - 1)
        for name in sorted(n[len(prefix) :] for n in params if n.startswith(prefix)):
            expert = local_expert_of(name)
            if expert is not None:
                experts.setdefault(expert[0], {})[expert[1]] = prefix + name
                continue
            canonical = canonical_layer_param(name)
            if canonical not in mapped:
                raise WeightSyncError(f"no HF mapping for actor parameter {prefix}{name}")
            order.append((megatron_layer_key(canonical), prefix + name, layer.layer_number - 1))
        for key, by_index in sorted(experts.items()):
            names = tuple(by_index[j] for j in range(len(by_index)))
            order.append((megatron_layer_key(key), names, layer.layer_number - 1))
    if gpt.post_process:
        order.append((FINAL_NORM, "decoder.final_layernorm.weight", None))
        if not actor.model_config.tie_word_embeddings:
            order.append((OUTPUT_LAYER, "output_layer.weight", None))
    return order


def iter_weight_buckets(actor, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
    """This stage's weights packed into buckets of about ``bucket_bytes`` (leader only)."""
    bucket = WeightBucket()
    size = 0
    for name, tensor in iter_hf_tensors(actor):
        if bucket.tensors and size + tensor.nbytes > bucket_bytes:
            yield bucket
            bucket, size = WeightBucket(), 0
        bucket.tensors.append((name, tensor))
        size += tensor.nbytes
    if bucket.tensors:
        yield bucket


def iter_piece_buckets(actor, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
    """This rank's own shards as buckets of pieces (views of its parameters, with their
    offsets in the HF tensors); empty on ranks outside the first data-parallel replica
    that hold no experts to send.
    No collective: every rank of the replica calls it independently. ``bucket_bytes``
    bounds the bytes of a bucket that must be staged to be sent: pieces of parameters in
    shared memory (colocated engines on the CPU) are references, so they all fit in one.
    Experts are sent by the ranks that hold them (expert-data-parallel rank 0), which may
    be outside the first replica."""
    runtime = actor.runtime
    shape = ModelShape.from_model_config(actor.model_config)
    tp_rank, tp_size = runtime.tp_rank, actor.parallel.tp_size
    params = dict(actor.gpt.named_parameters())
    local_experts = (shape.num_experts or 0) // actor.parallel.ep_size

    def pieces(key, param_names, layer_index):
        if isinstance(param_names, tuple):
            # Whole experts, sent by the first rank of those that hold them (its
            # expert-data-parallel rank 0; it may sit in another replica).
            if runtime.expert_dp_rank == 0:
                first = runtime.ep_rank * local_experts
                for j, param_name in enumerate(param_names):
                    own = params[param_name].detach().unsqueeze(0)  # a view: no copy
                    for name, piece in expert_to_hf(key, own, layer_index, [first + j]).items():
                        yield name, piece, (0,) * piece.dim()
        elif runtime.dp_rank == 0:
            yield from shard_to_hf_pieces(key, params[param_names].detach(), shape, layer_index, tp_rank, tp_size)

    bucket, size = WeightBucket(), 0
    for key, param_names, layer_index in _stage_params_in_order(actor):
        for name, piece, offset in pieces(key, param_names, layer_index):
            # A bucket bounds what must be staged (copied into a shareable buffer) to
            # send it; a piece of shared memory travels as a reference and stages nothing.
            staged = 0 if piece.is_shared() and piece.is_contiguous() else piece.nbytes
            if bucket.tensors and size + staged > bucket_bytes:
                yield bucket
                bucket, size = WeightBucket(), 0
            bucket.tensors.append((name, piece))
            bucket.offsets.append(offset)
            size += staged
    if bucket.tensors:
        yield bucket


def _send_bucket(bucket: Optional[WeightBucket], dst: int) -> int:
    """Send one bucket (or the end marker None) as metadata plus one flat byte buffer;
    the tensor bytes sent."""
    meta = None if bucket is None else [(n, tuple(t.shape), t.dtype) for n, t in bucket.tensors]
    dist.send_object_list([meta], dst=dst)
    if bucket is None:
        return 0
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket.tensors])
    dist.send(flat, dst=dst)
    return flat.numel()


def recv_buckets(src: int, device: torch.device) -> Iterator[WeightBucket]:
    """The buckets ``src`` sends with :func:`_send_bucket`, received into buffers on
    ``device``: the one the default group's backend serves (NCCL moves only CUDA
    tensors; a CPU buffer there raises), i.e. the runtime's device."""
    while True:
        holder = [None]
        dist.recv_object_list(holder, src=src)
        meta = holder[0]
        if meta is None:
            return
        total = sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in meta)
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        dist.recv(flat, src=src)
        bucket, offset = WeightBucket(), 0
        for name, shape, dtype in meta:
            size = torch.Size(shape).numel() * dtype.itemsize
            bucket.tensors.append((name, flat[offset : offset + size].view(dtype).view(shape)))
            offset += size
        yield bucket


def _roles(actor) -> SyncRoles:
    if getattr(actor, "_sync_roles", None) is None:
        runtime = actor.runtime
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (runtime.rank, runtime.dp_rank, runtime.tp_rank, runtime.pp_rank))
        actor._sync_roles = sync_roles(everyone)
    return actor._sync_roles


def sync_weights(
    actor,
    engine: Optional[WeightSink],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    feeders: tuple[int, ...] = (0,),
) -> Optional[SyncStats]:
    """Push the actor's current weights into the engines. Collective over all actor ranks.

    ``feeders`` are the global ranks that feed an engine (each rank in it passes its own
    ``engine``, typically the engines on its node; the others pass None), stage leaders
    of any replica. Each replica with a feeder gathers its own stages, and each of its
    stage leaders streams its buckets to that replica's other feeders only (every
    replica holds the whole model: nothing crosses replicas, and no rank relays more
    than its own stage to its own replica's feeders); each feeder hands its engine all
    stages' buckets in model order, so several engines are fed at once, each by a rank
    near it. Returns the sync's statistics on the feeders (wall time includes gathering
    and conversion), None elsewhere. Raises :class:`WeightSyncError` on a feeder whose
    engine refuses the weights; it then keeps its previous ones.
    """
    start = time.perf_counter()
    rank = dist.get_rank()
    feeders = tuple(sorted(set(feeders)))
    roles = _roles(actor)
    check_feeders(feeders, roles.valid_feeders)
    replica = roles.replica_of[rank]
    leaders = roles.leaders[replica]
    own_feeders = [f for f in feeders if roles.replica_of[f] == replica]
    others = [f for f in own_feeders if f != rank]
    stats = None
    error: Optional[BaseException] = None

    actor.last_sync_sent_bytes = 0  # bytes this rank sent to other feeders (tests, plan)

    def own_buckets() -> Iterator[WeightBucket]:
        # This stage's buckets, sent to every other feeder as they are made.
        for bucket in iter_weight_buckets(actor, bucket_bytes):
            for feeder in others:
                actor.last_sync_sent_bytes += _send_bucket(bucket, feeder)
            yield bucket
        for feeder in others:
            _send_bucket(None, feeder)

    if rank in feeders:
        if engine is None:
            raise ValueError(f"sync_weights: feeder rank {rank} was given no engine")

        def stream() -> Iterator[WeightBucket]:
            # Stages in model order: earlier stages' buckets come first on every feeder,
            # which is what keeps the sends of all stage leaders free of cycles.
            for leader in leaders:
                yield from own_buckets() if leader == rank else recv_buckets(leader, actor.runtime.device)

        buckets = stream()
        try:
            engine_stats = engine.update_weights(buckets)
            stats = SyncStats(
                time.perf_counter() - start, engine_stats.num_bytes, engine_stats.num_tensors, engine_stats.num_buckets
            )
        except BaseException as exc:  # drain the other stages so they do not hang, then raise
            error = exc
            for _ in buckets:
                pass
    elif not own_feeders:
        if actor.parallel.ep_size > 1:  # its experts are gathered into the fed replicas
            for _ in iter_weight_buckets(actor, bucket_bytes):
                pass
    elif rank in leaders:
        for _ in own_buckets():
            pass
    else:
        for _ in iter_weight_buckets(actor, bucket_bytes):  # this stage's gathers are collective
            pass
    dist.barrier()
    if error is not None:
        raise error
    return stats
