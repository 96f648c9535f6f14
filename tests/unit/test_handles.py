"""Buckets cross processes by handle: a few hundred bytes that map the sender's memory."""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import sys
import types
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch

from dapo_megatron.weight_sync.bucket import WeightBucket
from dapo_megatron.weight_sync.handles import (
    BucketReceiver,
    SharedBucketBuffer,
    remove_shared_files_of,
    share_storage,
    tensor_handle,
)


def _child(handle, queue):
    bucket = BucketReceiver().open(handle)
    queue.put({name: (t.float().tolist(), t.dtype) for name, t in bucket.tensors})  # by value, no sharing
    for _, tensor in bucket.tensors:
        tensor.fill_(7)  # writes land in the sender's memory: the same memory, not a copy


def _bucket():
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(3 * 4096, generator=gen)  # one storage holding two "parameters"
    share_storage(params)
    return (
        params,
        WeightBucket(
            [
                ("a.weight", params[:4096].view(64, 64)),  # views of shared memory: referenced
                ("b.weight", params[4096:8192].view(64, 64)),
                ("c.bias", torch.randn(33, generator=gen).to(torch.bfloat16)),  # private: staged
                ("d.weight", torch.randn(16, 8, generator=gen).t()),  # not contiguous: staged
            ]
        ),
    )


def test_a_bucket_is_read_in_another_process_through_its_handle():
    params, bucket = _bucket()
    expected = {name: t.clone() for name, t in bucket.tensors}
    packer = SharedBucketBuffer(torch.device("cpu"))
    handle = packer.pack(bucket)
    assert handle.num_bytes == bucket.num_bytes
    assert len(handle.buffers) == 2  # the parameters' storage and the staging buffer
    assert sum(len(h) for h in handle.buffers) < 2048 < bucket.num_bytes  # handles, not data
    # The referenced tensors are not copied: a change after packing is what the receiver sees.
    params[0] = 123.0
    expected["a.weight"][0, 0] = 123.0
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child, args=(handle, queue))
    child.start()
    received = {name: torch.tensor(values).to(dtype) for name, (values, dtype) in queue.get(timeout=120).items()}
    child.join(timeout=60)
    assert child.exitcode == 0
    assert all(torch.equal(received[name], expected[name]) for name in expected)
    assert set(received) == set(expected)
    assert torch.equal(params[:8192], torch.full((8192,), 7.0)) and not torch.equal(
        params[8192:], torch.full((4096,), 7.0)
    )
    # The next bucket reuses the same handles: no new shared memory in steady state.
    again = packer.pack(bucket)
    assert again.buffers == handle.buffers
    packer.close()


def test_the_driver_removes_only_what_finished_ranks_left_in_shared_memory():
    child = multiprocessing.get_context("spawn").Process(target=os.getpid)
    child.start()
    child.join(timeout=120)
    # What a killed rank leaves behind (torch names the file after its creator), and a
    # file of another process, which must stay.
    left = Path(f"/dev/shm/torch_{child.pid}_123_0")
    other = Path(f"/dev/shm/torch_{child.pid}0_123_0")
    for path in (left, other):
        path.write_bytes(b"x" * 64)
    try:
        assert remove_shared_files_of([child.pid]) == 1
        assert not left.exists() and other.exists()
    finally:
        other.unlink(missing_ok=True)
        left.unlink(missing_ok=True)


@dataclass
class _Metadata:
    """SGLang's FlattenedTensorMetadata (weight_sync/tensor_bucket.py), as far as its fields."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _stand_in_sglang(monkeypatch) -> None:
    """The three SGLang names ``sglang_bucket_payload`` imports: its serializer (torch's
    ForkingPickler, as SGLang's MultiprocessingSerializer dumps), its reduction patch (a
    no-op on the CPU) and the flattened bucket's metadata class."""

    def serialize(obj) -> bytes:
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(obj)
        return buffer.getvalue()

    modules = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.utils": types.SimpleNamespace(MultiprocessingSerializer=types.SimpleNamespace(serialize=serialize)),
        "sglang.srt.utils.patch_torch": types.SimpleNamespace(monkey_patch_torch_reductions=lambda: None),
        "sglang.srt.weight_sync": types.ModuleType("sglang.srt.weight_sync"),
        "sglang.srt.weight_sync.tensor_bucket": types.SimpleNamespace(FlattenedTensorMetadata=_Metadata),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def _torch_files() -> set[str]:
    return {path.name for path in Path("/dev/shm").glob(f"torch_{os.getpid()}_*")}


def test_each_serialized_bucket_is_shared_once_per_reader_and_freed_after_it(monkeypatch):
    """SGLang's colocated path: a feeder streams 3 buckets (the third larger than the
    first, which shared its buffer: a buffer that grows) to 2 engines of TP 4, through
    the real ``sglang_bucket_payload`` and ``_stream_by_handle``. Counting torch's
    storage shares (``_share_filename_cpu_``, the CPU twin of ``_share_cuda_``, which
    wraps a CUDA storage anew on every call): each bucket's staging is shared exactly once
    per TP worker, 24 shares in all (not once per tensor and worker, and none that nobody
    opens); every worker reads the sender's values from its payload as SGLang's
    flattened_bucket path does; every staging tensor is freed once its readers are done,
    and no shared-memory file is left behind."""
    from dapo_megatron.orchestration import actor_group
    from dapo_megatron.rollout.sglang_engine import sglang_bucket_payload
    from dapo_megatron.weight_sync.bucket import unflatten_bucket

    _stand_in_sglang(monkeypatch)
    shares: list[int] = []  # the storage (data pointer) of every share torch makes
    share = torch.UntypedStorage._share_filename_cpu_

    def counted_share(storage, *args):
        handle = share(storage, *args)  # the first share moves the storage into shared memory
        shares.append(storage.data_ptr())
        return handle

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", counted_share)
    staged: list[weakref.ref] = []  # each bucket's staging tensor

    def serialize(flat, layout) -> bytes:
        before = len(shares)
        if not staged or staged[-1]() is not flat:
            staged.append(weakref.ref(flat))
            if len(staged) == 3:  # packed into the first bucket's buffer: that staging is gone
                assert staged[0]() is None
        payload = sglang_bucket_payload(flat, layout)
        assert shares[before:] == [flat.untyped_storage().data_ptr()]  # one share, of the bucket's staging
        return payload

    read: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    class Engine:
        """An engine of TP 4: its worker r opens payload r alone, as SGLang's TP workers do."""

        def __init__(self, index):
            outer = self
            self.index = index

            class _Load:
                @staticmethod
                def remote(handle, last):
                    assert len(handle.serialized) == 4
                    for rank, payload in enumerate(handle.serialized):
                        for name, tensor in unflatten_bucket(pickle.loads(payload)):
                            read.setdefault((outer.index, rank), {})[name] = tensor.clone()

            self.load_weight_bucket_handle = _Load()

    monkeypatch.setattr(actor_group, "_await_engines", lambda refs, bound_s, names=None: refs)
    gen = torch.Generator().manual_seed(0)
    buckets = [
        WeightBucket([("a.weight", torch.randn(8, 16, generator=gen)), ("a.bias", torch.randn(33, generator=gen))]),
        WeightBucket([("b.weight", torch.randn(16, 8, generator=gen).t().to(torch.bfloat16))]),  # not contiguous
        WeightBucket([("c.weight", torch.randn(64, 64, generator=gen)), ("c.norm", torch.randn(7, generator=gen))]),
    ]
    sent = {name: tensor.clone() for bucket in buckets for name, tensor in bucket.tensors}
    files = _torch_files()
    buffers = [SharedBucketBuffer(torch.device("cpu")) for _ in range(2)]
    stats = actor_group._stream_by_handle(
        iter(buckets), buffers, [Engine(0), Engine(1)], 60.0, serialize=serialize, readers_per_engine=4
    )
    assert stats == (sum(b.num_bytes for b in buckets), 5, 3)
    assert len(shares) == 3 * 2 * 4  # buckets x engines x TP workers: was 5 x 2 x 4 + one per buffer allocation
    assert len(staged) == 3 and all(ref() is None for ref in staged)  # nothing kept after the sync
    assert sorted(read) == [(e, r) for e in range(2) for r in range(4)]
    for tensors in read.values():
        assert tensors.keys() == sent.keys()
        assert all(torch.equal(tensors[name], sent[name]) and tensors[name].dtype == sent[name].dtype for name in sent)
    assert _torch_files() <= files  # every staging's shared memory is gone
    # The check's own control: a handle nobody opens (what the buffers made on every
    # allocation) keeps its memory's file after the tensor is freed.
    unopened = torch.ones(4096)
    tensor_handle(unopened.share_memory_())
    del unopened
    left = _torch_files() - files
    assert len(left) == 1
    for name in left:
        (Path("/dev/shm") / name).unlink()
