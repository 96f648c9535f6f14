"""Where rollout engines go: GPU slots per node, aborted groups, as pure functions."""

from __future__ import annotations

import pytest

from dapo_megatron.orchestration.rollout import engine_gpu_bases, reserved_gpu_base


def test_colocated_engines_take_consecutive_slots_per_node():
    nodes = ["a", "b", "a", "a", "b"]
    assert engine_gpu_bases(nodes, 2, 8) == [0, 0, 2, 4, 2]
    assert engine_gpu_bases(["a"] * 4, 1, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"node a holds 3 engines of engine_tp_size=2 \(6 GPUs\) but has 4"):
        engine_gpu_bases(["a", "a", "a"], 2, 4)


def test_separate_engines_use_the_consecutive_gpus_ray_reserved():
    assert reserved_gpu_base([5, 4], 2) == 4
    with pytest.raises(ValueError, match=r"needs 2 consecutive GPUs of its own; Ray reserved \[1, 3\]"):
        reserved_gpu_base([3, 1], 2)
    with pytest.raises(ValueError, match="reserved"):
        reserved_gpu_base([], 1)
