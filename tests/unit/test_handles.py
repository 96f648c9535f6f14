"""Buckets cross processes by handle: a few hundred bytes that map the sender's memory."""

from __future__ import annotations

import multiprocessing

import torch

from dapo_megatron.orchestration.handles import BucketReceiver, SharedBucketBuffer, open_tensor_handle
from dapo_megatron.rollout.engine import WeightBucket


def _child(handle, queue):
    bucket = BucketReceiver().open(handle)
    sums = {name: float(t.double().sum()) for name, t in bucket.tensors}
    name, tensor = bucket.tensors[0]
    tensor.fill_(7)  # writes land in the sender's memory: it is the same memory, not a copy
    queue.put(sums)


def test_a_bucket_is_read_in_another_process_through_its_handle():
    gen = torch.Generator().manual_seed(0)
    bucket = WeightBucket(
        [
            ("a.weight", torch.randn(256, 128, generator=gen)),
            ("b.bias", torch.randn(33, generator=gen).to(torch.bfloat16)),
            ("c.weight", torch.randn(64, 64, generator=gen)),
        ]
    )
    buffer = SharedBucketBuffer(torch.device("cpu"))
    handle = buffer.pack(bucket)
    assert handle.num_bytes == bucket.num_bytes
    assert len(handle.buffer) < 1024 < bucket.num_bytes  # the handle, not the data
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child, args=(handle, queue))
    child.start()
    sums = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert sums == {name: float(t.double().sum()) for name, t in bucket.tensors}
    mapped = BucketReceiver().open(handle).tensors[0][1]
    assert torch.equal(mapped, torch.full((256, 128), 7.0))
    # A second bucket reuses the same shared buffer (same handle) when it fits.
    again = buffer.pack(WeightBucket([("d.weight", torch.ones(8))]))
    assert again.buffer == handle.buffer
    assert torch.equal(open_tensor_handle(again.buffer)[:32].view(torch.float32), torch.ones(8))
    buffer.close()
