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


def test_each_engine_is_fed_from_its_own_gpus_else_its_node():
    from dapo_megatron.orchestration.actor_group import choose_feeders

    # Two nodes of 8 GPUs, 16 ranks (rank r on GPU r % 8 of node r // 8); ranks 0 and 8
    # are stage leaders of the first replica, ranks 4..7 and 12..15 belong to another replica.
    ranks = [("a" if r < 8 else "b", [r % 8]) for r in range(16)]
    valid = {0, 8, *range(4, 8), *range(12, 16)}
    engines = [("a", [0, 1, 2, 3]), ("a", [4, 5, 6, 7]), ("b", [0, 1, 2, 3]), ("b", [4, 5, 6, 7])]
    assert choose_feeders(engines, ranks, valid) == {0: [0], 4: [1], 8: [2], 12: [3]}
    # No valid feeder on an engine's GPUs: the lowest on its node; none on the node: rank 0.
    assert choose_feeders([("a", [2, 3]), ("c", [0])], ranks, {0, 8, 5}) == {0: [0, 1]}
    assert choose_feeders([("a", [2, 3])], ranks, {5, 8}) == {5: [0]}
    # The CPU runtime: no GPUs anywhere, the lowest valid rank on the node.
    assert choose_feeders([("a", []), ("a", [])], [("a", []), ("a", [])], {0, 1}) == {0: [0, 1]}
