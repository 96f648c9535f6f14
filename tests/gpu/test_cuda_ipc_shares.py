"""The colocated weight sync's CUDA IPC shares on a real GPU, 100,000 buckets into a child.

Why: torch wraps a CUDA storage anew on every share (``_share_cuda_``) and releases the
wrappers, their ref-counter slots (files ``/dev/shm/torch_<pid>_*``, 10,000 slots each)
and their IPC events (past 1,000 a share blocks on ``cudaStreamSynchronize``) only when
the storage is freed. The sync once re-shared two long-lived buffers once per tensor and
TP worker, ~6,000 times per sync on the 32B recipe, for the whole run. It now packs each
bucket into a fresh staging tensor, serializes it once per reader and frees it once the
readers have loaded it (``handles.SharedBucketBuffer``, ``actor_group._stream_by_handle``).

Here the real ``_stream_by_handle`` streams 100,000 buckets into a child process that
opens each payload as SGLang's TP workers do (its own payload, each tensor read from its
byte range) and answers with the tensors' sums; every bucket must arrive with the
sender's values, this process's ref-counter files must not pile up, the staging must be
freed at the end, and the run must complete. A control shows the check would see the old
way: one long-lived storage shared again and again opens ref-counter file after file.
Skipped without a GPU; needs torch only (no SGLang: its serializer is ForkingPickler plus
a device-UUID patch, which one GPU does not need).

Run on a lent device: ``pytest -q -s tests/gpu/test_cuda_ipc_shares.py`` (about a minute or two).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_BUCKETS = 100_000
CHECK_EVERY = 10_000


def _ref_counter_files() -> int:
    """This process's files in /dev/shm (torch's CUDA IPC ref-counter files)."""
    return len(list(Path("/dev/shm").glob(f"torch_{os.getpid()}_*")))


def _payload(flat: torch.Tensor, layout) -> bytes:
    """``sglang_bucket_payload`` without SGLang: the flattened bucket pickled by
    ForkingPickler (one ``_share_cuda_`` of ``flat``)."""
    from dapo_megatron.weight_sync.bucket import flat_bucket

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(flat_bucket(flat, layout))
    return buffer.getvalue()


def _reader(requests, answers) -> None:
    """An engine's TP worker: open each payload once, read each tensor from its byte
    range, answer with the sums (float64: exact for these values), drop everything."""
    from dapo_megatron.weight_sync.bucket import unflatten_bucket

    torch.cuda.init()
    while True:
        payload = requests.get()
        if payload is None:
            return
        tensors = unflatten_bucket(pickle.loads(payload))
        sums = [float(tensor.double().sum()) for _, tensor in tensors]
        del tensors  # the share's release (its count drops to 0 on the sender's side), before answering
        answers.put(sums)


def _bucket(index: int):
    """Bucket ``index``: two tensors with values fixed by ``index``; every 1,000th is 16
    times larger (the staging grows, then shrinks again)."""
    from dapo_megatron.weight_sync.bucket import WeightBucket

    n = 4096 if index % 1000 == 999 else 256
    a = torch.arange(n, device="cuda", dtype=torch.float32) + index
    b = torch.full((n // 2, 2), float(index % 7), device="cuda", dtype=torch.bfloat16)
    return WeightBucket([("a", a), ("b", b)])


def _sums(index: int) -> list[float]:
    n = 4096 if index % 1000 == 999 else 256
    return [float(n * (n - 1) // 2 + n * index), float(n * (index % 7))]


def test_a_hundred_thousand_buckets_share_into_a_child_without_piling_up(monkeypatch):
    from dapo_megatron.orchestration import actor_group
    from dapo_megatron.weight_sync.handles import SharedBucketBuffer

    context = multiprocessing.get_context("spawn")
    requests, answers = context.Queue(), context.Queue()
    child = context.Process(target=_reader, args=(requests, answers), daemon=True)
    child.start()
    sent: list[int] = []  # indices of the buckets made and not yet answered, in order
    seen = {"buckets": 0, "files": [], "times": []}
    start = time.perf_counter()

    class Child:
        """The engine: its one TP worker is the child process."""

        class load_weight_bucket_handle:  # noqa: N801 - Ray's method.remote shape
            @staticmethod
            def remote(handle, last):
                assert len(handle.serialized) == 1 and handle.buffers == ()
                requests.put(handle.serialized[0])
                return "answer"  # awaited in order: the oldest bucket in `sent` is the one answered

    def await_answers(refs, bound_s, names=None):
        for _ in refs:
            index = sent.pop(0)
            assert answers.get(timeout=120) == _sums(index), f"bucket {index} arrived with other values"
            seen["buckets"] += 1
            if seen["buckets"] % CHECK_EVERY == 0:
                seen["files"].append(_ref_counter_files())
                seen["times"].append(time.perf_counter() - start)
                print(f"{seen['buckets']} buckets, {seen['files'][-1]} ref-counter file(s), {seen['times'][-1]:.0f} s")
        return refs

    def buckets():
        for index in range(NUM_BUCKETS):
            sent.append(index)
            yield _bucket(index)

    monkeypatch.setattr(actor_group, "_await_engines", await_answers)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    buffers = [SharedBucketBuffer(torch.device("cuda")) for _ in range(2)]
    try:
        stats = actor_group._stream_by_handle(
            buckets(), buffers, [Child()], 600.0, serialize=_payload, readers_per_engine=1
        )
    finally:
        requests.put(None)
        child.join(timeout=60)
    assert stats[1:] == (2 * NUM_BUCKETS, NUM_BUCKETS) and seen["buckets"] == NUM_BUCKETS
    assert child.exitcode == 0
    # 100,000 shares would fill 10 ref-counter files if none were released; freed
    # storages return their slots, and a file whose slots are all back is removed.
    assert max(seen["files"]) <= 2, seen["files"]
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline  # the staging is freed after the stream
    for buffer in buffers:
        buffer.close()


def test_the_control_one_long_lived_storage_re_shared_piles_up_files():
    """What the old sync did, without a reader: the same storage shared again and again
    keeps every share's ref-counter slot while it lives, so new files (10,000 slots each)
    keep being opened: two more within 25,000 shares. (Unopened, they go to torch's
    limbo when the storage is freed, not through the nested deleters.)"""
    from dapo_megatron.weight_sync.handles import tensor_handle

    before = _ref_counter_files()
    buffer = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    shares = 0
    while _ref_counter_files() - before < 2 and shares < 25_000:
        tensor_handle(buffer[shares % 4096 :])
        shares += 1
    assert _ref_counter_files() - before >= 2, f"{shares} shares of one storage opened no second file"
    print(f"two more ref-counter files after {shares} shares of one storage")
