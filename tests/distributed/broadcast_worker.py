"""Both ends of the separate weight-update group, on gloo: our sender, and a receiver that
does what SGLang's weight updater does with an announcement (one broadcast per tensor
from rank 0, in the announced order)."""

from __future__ import annotations

import os
import time

import torch

from dapo_megatron.weight_sync.broadcast import broadcast_buckets, init_weight_update_group
from dapo_megatron.weight_sync.bucket import WeightBucket


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=gen),
        "model.norm.weight": torch.randn(4, generator=gen),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=gen).to(torch.bfloat16),
        "lm_head.weight": torch.randn(10, 4, generator=gen),
    }


def run(rank: int, port: int, world_size: int, out_dir: str) -> None:
    group = init_weight_update_group("127.0.0.1", port, rank, world_size, "weight_update_group", backend="gloo")
    if rank == 0:
        items = list(weights().items())
        buckets = [WeightBucket(items[:3]), WeightBucket(items[3:])]

        def announce(names, dtypes, shapes, last):
            # In a real run a Ray call to every engine; here the receivers read it from a file.
            torch.save((names, dtypes, shapes, last), os.path.join(out_dir, f"announce_{announce.count}.pt"))
            announce.count += 1
            torch.distributed.barrier(group=group)

        announce.count = 0
        stats = broadcast_buckets(buckets, group, announce)
        torch.save(stats, os.path.join(out_dir, "stats.pt"))
        _finish(group, rank, world_size, out_dir)
        return
    received = {}
    for index in range(2):
        torch.distributed.barrier(group=group)
        names, dtypes, shapes, last = torch.load(os.path.join(out_dir, f"announce_{index}.pt"))
        for name, dtype, shape in zip(names, dtypes, shapes):  # SGLang's receive loop
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(tensor, src=0, group=group)
            received[name] = tensor
        if last:
            break
    torch.save(received, os.path.join(out_dir, f"received_{rank}.pt"))
    _finish(group, rank, world_size, out_dir)


def _finish(group, rank: int, world_size: int, out_dir: str) -> None:
    """Rank 0 hosts the group's TCP store: nobody leaves before everyone is done with it,
    and rank 0 leaves last, once every other rank has destroyed its end of the group (a
    store host that exits while clients still hold their connections was seen to abort,
    once, in its teardown)."""
    torch.distributed.barrier(group=group)
    torch.distributed.destroy_process_group(group)
    if rank != 0:
        open(os.path.join(out_dir, f"left_{rank}"), "w").close()
        return
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(out_dir, f"left_{r}")) for r in range(1, world_size)):
        assert time.monotonic() < deadline, "a receiver did not leave the weight-update group within 60 s"
        time.sleep(0.05)
