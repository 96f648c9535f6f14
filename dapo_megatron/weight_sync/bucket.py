"""What a weight update moves and who takes it: buckets of HF-named tensors (whole
tensors, or one tensor-parallel rank's pieces), their flat form for SGLang, the stats of
an update, and the protocol of a weight sink (an engine, or the proxy of one in another
process): a session of ``begin_weight_update``, ``load_weight_bucket`` per bucket, then
``end_weight_update`` (or ``abort_weight_update``).

The bottom of :mod:`dapo_megatron.weight_sync`, below both the actor that sends and the
engines that receive.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch


@dataclass
class WeightBucket:
    """A group of HF-named tensors sent together.

    The tensors may be views of the sender's live weights: an engine copies what it keeps
    before ``update_weights`` returns and never holds on to the bucket's tensors.
    """

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """``(hf_name, tensor)`` pairs."""
    offsets: list[tuple[int, ...]] = field(default_factory=list)
    """Empty: every tensor is whole. Otherwise one per tensor: the tensor is a *piece* of
    the HF tensor, starting at this index in every dimension (one tensor-parallel rank's
    shard; engines that accept pieces say so with ``accepts_pieces``)."""

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data in the bucket."""
        return sum(t.nbytes for _, t in self.tensors)


def flat_bucket(flat: torch.Tensor, layout, entry=None) -> dict:
    """A packed bucket as one flat ``uint8`` tensor and each tensor's byte range in it:
    ``{"flattened_tensor": flat, "metadata": [entry(name=, shape=, dtype=, start_idx=,
    end_idx=, numel=)]}``, the ``flattened_bucket`` payload SGLang 0.5.23's TP workers
    take (``entry``: its ``FlattenedTensorMetadata``; a ``SimpleNamespace`` by default).
    ``layout``: ``(name, shape, dtype, buffer_index, byte_offset)`` as the orchestration's
    ``BucketHandle`` holds it; ``numel`` counts bytes, as SGLang's own flattened buckets do."""
    entry = entry or types.SimpleNamespace
    metadata = []
    for name, shape, dtype, _, offset in layout:
        size = torch.Size(shape).numel() * dtype.itemsize
        metadata.append(
            entry(name=name, shape=torch.Size(shape), dtype=dtype, start_idx=offset, end_idx=offset + size, numel=size)
        )
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten_bucket(payload: dict) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a :func:`flat_bucket` payload, as views of its flat tensor
    (what an engine worker reads: each tensor's byte range, as its dtype and shape)."""
    flat = payload["flattened_tensor"]
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).view(m.shape)) for m in payload["metadata"]]


@dataclass
class SyncStats:
    """What one weight update moved."""

    seconds: float
    """Wall time from the first bucket to the last tensor in use."""
    num_bytes: int
    """Bytes of tensor data received."""
    num_tensors: int
    """Tensors received."""
    num_buckets: int
    """Buckets received."""


def with_last_flag(buckets: Iterable[WeightBucket]) -> Iterator[tuple[WeightBucket, bool]]:
    """``(bucket, is_last)`` pairs, holding one bucket back so the last one is known
    (engines flush their KV cache after it)."""
    pending: Optional[WeightBucket] = None
    for bucket in buckets:
        if pending is not None:
            yield pending, False
        pending = bucket
    if pending is not None:
        yield pending, True


class WeightSyncError(RuntimeError):
    """A weight update failed; the engine still serves its previous weights."""


class WeightSink(Protocol):
    """What takes a weight update (every :class:`~dapo_megatron.rollout.engine.RolloutEngine`
    is one): a session of buckets, all or nothing."""

    accepts_pieces: bool
    """Whether buckets may hold pieces of tensors (``WeightBucket.offsets``)."""

    def begin_weight_update(self) -> None:
        """Open a weight update: buckets follow, then :meth:`end_weight_update`."""

    def load_weight_bucket(self, bucket: WeightBucket, last: bool) -> None:
        """Take one bucket of the open update (copied before returning)."""

    def end_weight_update(self) -> SyncStats:
        """Close the update: every tensor arrived; serve them."""

    def abort_weight_update(self) -> None:
        """Drop an open update after a failure."""
