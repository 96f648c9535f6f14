"""The separate weight-update group: two receivers get every tensor of every bucket, exactly."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from dapo_megatron.runtime.distributed import find_free_port
from tests.distributed import broadcast_worker


def test_buckets_reach_every_receiver_bitwise(tmp_path):
    port = find_free_port()
    mp.start_processes(broadcast_worker.run, args=(port, 3, str(tmp_path)), nprocs=3, join=True, start_method="spawn")
    stats = torch.load(tmp_path / "stats.pt", weights_only=False)
    expected = broadcast_worker.weights()
    assert stats.num_buckets == 2 and stats.num_tensors == 4
    assert stats.num_bytes == sum(t.nbytes for t in expected.values())
    for rank in (1, 2):
        received = torch.load(tmp_path / f"received_{rank}.pt")
        assert sorted(received) == sorted(expected)
        for name, tensor in expected.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
