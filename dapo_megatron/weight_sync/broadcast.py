"""Send weight buckets to rollout engines on other GPUs over their own process group.

When engines do not share the actor's GPUs (SGLang's disaggregated mode), a trainer-side
sender and every engine rank form a separate process group: the sender is rank 0, engine
ranks follow (SGLang's ``init_weights_update_group`` with ``rank_offset=1``). For each
bucket, the engine is told the names, dtypes and shapes (SGLang's
``update_weights_from_distributed``), and the sender broadcasts the tensors in that order
from rank 0, which is exactly what SGLang's receiving side does with them.

The group is independent of the actor's default process group (its own TCP rendezvous
and store prefix), built the same way SGLang builds its side, so both ends agree. NCCL on
GPU; gloo works for tests on a CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist

from dapo_megatron.weight_sync.bucket import SyncStats, WeightBucket, with_last_flag
from dapo_megatron.weight_sync.update_group import init_weight_update_group

__all__ = ["broadcast_buckets", "bucket_metadata", "init_weight_update_group"]


def bucket_metadata(bucket: WeightBucket) -> tuple[list[str], list[str], list[list[int]]]:
    """``(names, dtypes, shapes)`` as SGLang's ``update_weights_from_distributed`` takes them."""
    names = [name for name, _ in bucket.tensors]
    dtypes = [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket.tensors]
    shapes = [list(tensor.shape) for _, tensor in bucket.tensors]
    return names, dtypes, shapes


def broadcast_buckets(
    buckets: Iterable[WeightBucket],
    group,
    announce: Callable[[list[str], list[str], list[list[int]], bool], Any],
    *,
    device: Optional[torch.device] = None,
) -> SyncStats:
    """Stream buckets to the engines: announce each, then broadcast its tensors from rank 0.

    ``announce(names, dtypes, shapes, last)`` must start the engines' receive without
    waiting for it (e.g. a Ray ``.remote()`` call of
    :meth:`SGLangRolloutEngine.receive_broadcast_bucket`) and may return a handle with a
    ``wait()`` or ``result()`` method, which is waited on after the broadcasts.
    """

    start = time.perf_counter()
    num_bytes = num_tensors = num_buckets = 0

    def send(bucket: WeightBucket, last: bool) -> None:
        handle = announce(*bucket_metadata(bucket), last)
        for _, tensor in bucket.tensors:
            dist.broadcast(tensor.to(device) if device is not None else tensor.contiguous(), src=0, group=group)
        for method in ("wait", "result"):
            if hasattr(handle, method):
                getattr(handle, method)()
                break

    for bucket, last in with_last_flag(buckets):
        send(bucket, last)
        num_buckets += 1
        num_tensors += len(bucket.tensors)
        num_bytes += bucket.num_bytes
    return SyncStats(time.perf_counter() - start, num_bytes, num_tensors, num_buckets)
