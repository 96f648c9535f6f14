"""Tensors handed between processes by handle, never by value.

The actor's ranks and the rollout engines are different processes. Copying a bucket of
weights through Ray's object store (or pickling it by value) would move a 32B model's
65 GB twice every step. Instead the sender packs each bucket into a buffer that other
processes can map, and sends only a *handle* to it: a few hundred bytes naming the
memory. The receiver maps the same memory and copies out what it keeps.

- On a GPU the buffer is a CUDA tensor and the handle is its CUDA IPC handle: the
  serialized form SGLang's ``update_weights_from_tensor`` takes (torch's
  ``ForkingPickler`` reductions, which SGLang's ``MultiprocessingSerializer`` uses).
- On the CPU the buffer lives in shared memory (torch.multiprocessing's tensor sharing
  with the ``file_system`` strategy, so an unrelated process can open it by name), and
  the handle is made by the same ``ForkingPickler``: the CPU tests exercise the handle
  design itself.

A :class:`SharedBucketBuffer` is allocated once and reused by every sync; the receiver
caches the mapping per handle, so steady-state syncs create no new shared memory.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp

from dapo_megatron.rollout.engine import WeightBucket


def use_shareable_cpu_tensors() -> None:
    """Make CPU tensors shareable by name with unrelated processes (called in every
    process that sends or receives handles)."""
    torch_mp.set_sharing_strategy("file_system")


def tensor_handle(tensor: torch.Tensor) -> bytes:
    """The serialized handle of a shared-memory (CPU) or CUDA tensor: never its data."""
    if tensor.device.type == "cpu" and not tensor.is_shared():
        raise ValueError("tensor_handle needs a shared-memory CPU tensor (share_memory_()) or a CUDA tensor")
    use_shareable_cpu_tensors()
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(tensor)
    return buffer.getvalue()


def open_tensor_handle(handle: bytes) -> torch.Tensor:
    """The tensor a handle names, mapped into this process (no copy)."""
    use_shareable_cpu_tensors()
    return pickle.loads(handle)


@dataclass(frozen=True)
class BucketHandle:
    """A bucket in transit: the handle of its flat byte buffer and its tensors' layout."""

    buffer: bytes
    """Handle of the flat ``uint8`` buffer (see :func:`tensor_handle`)."""
    layout: tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]
    """``(hf_name, shape, dtype, byte_offset)`` of each tensor in the buffer."""

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data the bucket carries."""
        return sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype, _ in self.layout)


class SharedBucketBuffer:
    """One reusable shareable buffer that buckets are packed into, one at a time.

    Grows (a new allocation, hence a new handle) only when a bucket is larger than any
    before it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flat: torch.Tensor | None = None
        self._handle: bytes | None = None

    def pack(self, bucket: WeightBucket) -> BucketHandle:
        """Copy ``bucket``'s tensors into the buffer and return its handle and layout."""
        total = sum(_aligned(t.nbytes) for _, t in bucket.tensors)
        if self._flat is None or self._flat.numel() < total:
            self._flat = torch.empty(total, dtype=torch.uint8, device=self.device)
            if self.device.type == "cpu":
                self._flat.share_memory_()
            self._handle = tensor_handle(self._flat)
        layout, offset = [], 0
        for name, tensor in bucket.tensors:
            size = tensor.nbytes
            target = self._flat[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            target.copy_(tensor)
            layout.append((name, tuple(tensor.shape), tensor.dtype, offset))
            offset += _aligned(size)
        return BucketHandle(self._handle, tuple(layout))

    def close(self) -> None:
        """Free the buffer (its shared memory goes once every receiver dropped it too)."""
        self._flat, self._handle = None, None


class BucketReceiver:
    """The receiving end: maps a bucket handle (cached per buffer) into a WeightBucket of views."""

    max_mapped = 4
    """Buffers kept mapped (a sender double-buffers; more would be stale)."""

    def __init__(self) -> None:
        self._mapped: dict[bytes, torch.Tensor] = {}

    def open(self, bucket: BucketHandle) -> WeightBucket:
        flat = self._mapped.get(bucket.buffer)
        if flat is None:
            # Senders alternate between a few buffers; one that grew replaces the oldest.
            if len(self._mapped) >= self.max_mapped:
                self._mapped.pop(next(iter(self._mapped)))
            flat = self._mapped[bucket.buffer] = open_tensor_handle(bucket.buffer)
        tensors = []
        for name, shape, dtype, offset in bucket.layout:
            size = torch.Size(shape).numel() * dtype.itemsize
            tensors.append((name, flat[offset : offset + size].view(dtype).view(shape)))
        return WeightBucket(tensors)

    def close(self) -> None:
        """Drop every mapping."""
        self._mapped = {}


def _aligned(num_bytes: int, alignment: int = 64) -> int:
    return -(-num_bytes // alignment) * alignment
