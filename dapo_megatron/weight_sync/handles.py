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

For engines whose own workers map the tensors (SGLang's TP workers), the sender packs each
bucket into a *fresh* staging tensor and serializes it once per reader, whole, with the
tensors' byte ranges (:func:`~dapo_megatron.rollout.engine.flat_bucket`, SGLang's
``flattened_bucket`` format); the staging tensor is freed once its readers have loaded
it. Not one long-lived buffer
serialized once per tensor and reader: torch wraps a CUDA storage anew on every share and
releases none of the wrappers (nor their ref-counter slots in ``/dev/shm``, nor their IPC
events: past 1,000 a share blocks on ``cudaStreamSynchronize``) until the storage is
freed, so the 32B recipe's 771 tensors x 8 TP workers per sync would pile up for the
whole run, and freeing the buffer at the end would unwind millions of nested wrappers.

On the CPU the actor's parameters themselves are moved into shared memory once
(:func:`share_storage`), so a bucket of tensors that are views of them is sent as
references into that memory and the sender copies nothing; only tensors the sync had to
rearrange (or gather) are copied into a reusable staging buffer. The receiver caches the
mapping per handle, so steady-state syncs create no new shared memory, and the engine
makes the one copy it needs to swap weights all or nothing. The driver removes the
ranks' shared-memory files once they are gone (:func:`remove_shared_files_of`).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing as torch_mp

from dapo_megatron.weight_sync.bucket import WeightBucket


def remove_shared_files_of(pids: list[int]) -> int:
    """Remove the shared-memory files that the (finished) processes ``pids`` created.

    torch names them ``torch_<pid>_...`` and removes one only when the last process
    mapping it frees it; a process that is killed, or whose tensors are still referenced
    when it exits (megatron keeps references to the parameters), leaves its files in
    ``/dev/shm``. The driver calls this for the actor ranks it started, after they are
    gone, so a run leaves nothing behind. Returns how many files were removed.
    """
    removed = 0
    for pid in pids:
        for path in Path("/dev/shm").glob(f"torch_{int(pid)}_*"):
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
    return removed


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
    """A bucket in transit: handles of the buffers its tensors live in, and their layout."""

    buffers: tuple[bytes, ...]
    """Handles of flat ``uint8`` buffers (see :func:`tensor_handle`)."""
    layout: tuple[tuple[str, tuple[int, ...], torch.dtype, int, int], ...]
    """``(hf_name, shape, dtype, buffer_index, byte_offset)`` of each (contiguous) tensor."""
    offsets: tuple[tuple[int, ...], ...] = ()
    """The bucket's piece offsets (see :class:`WeightBucket`); empty for whole tensors."""
    serialized: tuple[bytes, ...] = ()
    """The whole bucket serialized by the sender for engines that map it in processes of
    their own (SGLang's TP workers: see ``sglang_engine.sglang_bucket_payload``), once per
    reader: ``serialized[r]`` is reader ``r``'s (a CUDA IPC share is opened once, by one
    process: torch counts each share's release); empty otherwise (``buffers`` then name
    the memory)."""

    def for_readers(self, first: int, count: int) -> BucketHandle:
        """This handle with only readers ``first .. first + count - 1``'s payloads (one
        engine's TP workers)."""
        return dataclasses.replace(self, serialized=self.serialized[first : first + count])

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data the bucket carries."""
        return sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype, _, _ in self.layout)


def share_storage(tensor: torch.Tensor) -> None:
    """Move ``tensor``'s whole storage into shared memory, in place (every view of it
    follows), so buckets can name it instead of copying it."""
    storage = tensor.untyped_storage()
    if tensor.device.type == "cpu" and not storage.is_shared():
        use_shareable_cpu_tensors()
        storage.share_memory_()


class SharedBucketBuffer:
    """Turns buckets into handles, copying as little as possible.

    A tensor that is a contiguous view of shared CPU memory (the actor's parameters once
    :func:`share_storage` moved them there) travels as a reference into that memory: no
    copy at all on the sender. Any other tensor is copied into one reusable shareable
    staging buffer, which grows (a new allocation, hence a new handle) only when a bucket
    needs more than any before it.

    Buckets serialized for the engines' own workers (``pack(..., serialize)``) are staged
    instead in a fresh tensor per bucket, shared once per reader and freed when the next
    bucket is packed here (the caller has waited for its readers by then) or by
    :meth:`release_staging`: a CUDA storage is never shared more often than it has
    readers, and nothing shared outlives its bucket (see the module docstring).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flat: torch.Tensor | None = None
        self._handle: bytes | None = None
        self._storage_handles: dict[int, bytes] = {}

    def _storage_handle(self, tensor: torch.Tensor) -> bytes:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._storage_handles:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)  # [storage bytes]
            self._storage_handles[key] = tensor_handle(whole)
        return self._storage_handles[key]

    def pack(self, bucket: WeightBucket, serialize=None, readers: int = 1) -> BucketHandle:
        """Reference or copy ``bucket``'s tensors; return the handles and layout. With
        ``serialize(flat, layout) -> bytes``, copy them into a fresh staging tensor
        instead (the previous bucket's is freed) and serialize it ``readers`` times, a
        payload for each process that will open it, and make no handle of it."""
        if serialize is not None:
            return self._pack_serialized(bucket, serialize, readers)
        referenced = [
            t.device.type == "cpu" and t.is_shared() and t.is_contiguous() and self.device.type == "cpu"
            for _, t in bucket.tensors
        ]
        total = sum(_aligned(t.nbytes) for (_, t), ref in zip(bucket.tensors, referenced) if not ref)
        if total and (self._flat is None or self._handle is None or self._flat.numel() < total):
            self._flat = torch.empty(total, dtype=torch.uint8, device=self.device)
            share_storage(self._flat)  # no-op for CUDA tensors: they travel by IPC handle
            self._handle = tensor_handle(self._flat)
        buffers: list[bytes] = []
        layout, offset = [], 0

        def index_of(handle: bytes) -> int:
            if handle not in buffers:
                buffers.append(handle)
            return buffers.index(handle)

        for (name, tensor), ref in zip(bucket.tensors, referenced):
            if ref:
                byte_offset = tensor.storage_offset() * tensor.element_size()
                layout.append(
                    (name, tuple(tensor.shape), tensor.dtype, index_of(self._storage_handle(tensor)), byte_offset)
                )
                continue
            self._stage(tensor, offset)
            layout.append((name, tuple(tensor.shape), tensor.dtype, index_of(self._handle), offset))
            offset += _aligned(tensor.nbytes)
        return BucketHandle(tuple(buffers), tuple(layout), tuple(bucket.offsets))

    def _stage(self, tensor: torch.Tensor, offset: int) -> None:
        """Copy ``tensor`` into the staging buffer at byte ``offset``."""
        self._flat[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)

    def _pack_serialized(self, bucket: WeightBucket, serialize, readers: int) -> BucketHandle:
        """``bucket`` copied into a fresh staging tensor, serialized once per reader."""
        self.release_staging()  # the previous bucket's: its readers have loaded it
        total = sum(_aligned(t.nbytes) for _, t in bucket.tensors)
        # [bucket bytes]; on the CPU the first payload moves it into shared memory
        self._flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        layout, offset = [], 0
        for name, tensor in bucket.tensors:
            self._stage(tensor, offset)
            layout.append((name, tuple(tensor.shape), tensor.dtype, 0, offset))
            offset += _aligned(tensor.nbytes)
        payloads = tuple(serialize(self._flat, layout) for _ in range(readers))
        return BucketHandle((), tuple(layout), tuple(bucket.offsets), payloads)

    def release_staging(self) -> None:
        """Drop the staging buffer (and its handle): after a serialized stream, whose
        readers have all loaded their buckets, nothing shared is kept until the next."""
        self._flat, self._handle = None, None

    def close(self) -> None:
        """Drop the staging buffer and the references (shared memory goes once every
        process dropped it too)."""
        self.release_staging()
        self._storage_handles = {}


class BucketReceiver:
    """The receiving end: maps a bucket's buffers (cached per handle) into a WeightBucket of views."""

    max_mapped = 4096
    """Buffers kept mapped: the sender's parameter storages and staging buffers are
    reused sync after sync, so this set stays small; the oldest goes beyond it."""

    max_opened = 64
    """Opened buckets kept (a sync resends the same few handles)."""

    def __init__(self) -> None:
        self._mapped: dict[bytes, torch.Tensor] = {}
        self._opened: dict[BucketHandle, WeightBucket] = {}

    def _map(self, handle: bytes) -> torch.Tensor:
        flat = self._mapped.get(handle)
        if flat is None:
            if len(self._mapped) >= self.max_mapped:
                self._mapped.pop(next(iter(self._mapped)))
            flat = self._mapped[handle] = open_tensor_handle(handle)
        return flat

    def open(self, bucket: BucketHandle) -> WeightBucket:
        """The bucket's tensors as views of the mapped buffers. A handle sent again (the
        sender resends its parameters' handles sync after sync) gets the same views
        without rebuilding them: views read the memory, whatever it now holds."""
        cached = self._opened.get(bucket)
        if cached is not None:
            return cached
        if len(self._opened) >= self.max_opened:
            self._opened.pop(next(iter(self._opened)))
        self._opened[bucket] = opened = self._views(bucket)
        return opened

    def _views(self, bucket: BucketHandle) -> WeightBucket:
        flats = [self._map(handle) for handle in bucket.buffers]
        tensors = []
        for name, shape, dtype, index, offset in bucket.layout:
            size = torch.Size(shape).numel() * dtype.itemsize
            tensors.append((name, flats[index][offset : offset + size].view(dtype).view(shape)))
        return WeightBucket(tensors, list(bucket.offsets))

    def close(self) -> None:
        """Drop every mapping."""
        self._mapped = {}
        self._opened = {}


def _aligned(num_bytes: int, alignment: int = 64) -> int:
    return -(-num_bytes // alignment) * alignment
