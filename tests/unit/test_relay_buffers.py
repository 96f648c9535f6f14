"""The pipeline relay of the weight sync receives into buffers on the runtime's device.

On NCCL a receive into a CPU buffer raises, so every sync with pp_size > 1 failed on a
GPU while the CPU allocation went unnoticed on gloo. Here the receive is recorded (one
process, the collective calls replaced) and the buffers must lie on the device asked
for; the real relay runs on gloo in ``tests/distributed/test_weight_sync.py``.
"""

from __future__ import annotations

import torch

from dapo_megatron.weight_sync import gather as weight_sync


def test_relay_buffers_follow_the_device(monkeypatch):
    sent = torch.arange(6, dtype=torch.float32).view(2, 3)
    messages = [[("w", (2, 3), torch.float32)], None]
    received_into = []

    def recv_object_list(holder, src):
        holder[0] = messages.pop(0)

    def recv(tensor, src):
        received_into.append(tensor.device)
        if tensor.device.type == "cpu":
            tensor.copy_(sent.view(-1).view(torch.uint8))

    monkeypatch.setattr(weight_sync.dist, "recv_object_list", recv_object_list)
    monkeypatch.setattr(weight_sync.dist, "recv", recv)
    (bucket,) = list(weight_sync.recv_buckets(1, torch.device("meta")))
    assert received_into == [torch.device("meta")] and bucket.tensors[0][1].device.type == "meta"
    messages[:] = [[("w", (2, 3), torch.float32)], None]
    (bucket,) = list(weight_sync.recv_buckets(1, torch.device("cpu")))
    assert bucket.tensors[0][0] == "w" and torch.equal(bucket.tensors[0][1], sent)
