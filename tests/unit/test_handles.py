"""Buckets cross processes by handle: a few hundred bytes that map the sender's memory."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import torch

from dapo_megatron.orchestration.handles import (
    BucketReceiver,
    SharedBucketBuffer,
    remove_shared_files_of,
    share_storage,
)
from dapo_megatron.rollout.engine import WeightBucket


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
