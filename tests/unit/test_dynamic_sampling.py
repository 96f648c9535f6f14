"""Dynamic sampling: fills across rounds, trims the surplus, fails clearly at the bound."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.algo import DynamicSamplingAccumulator, DynamicSamplingExhausted


def _round(prefix, group_rewards):
    items = [f"{prefix}{g}.{i}" for g, rewards in enumerate(group_rewards) for i in range(len(rewards))]
    return items, torch.tensor([r for rewards in group_rewards for r in rewards], dtype=torch.float32)


def test_fills_across_rounds_and_trims():
    acc = DynamicSamplingAccumulator(train_batch_size=3, group_size=2, max_num_gen_batches=5)
    acc.add(*_round("a", [[1, 1], [1, -1], [-1, -1]]))  # keeps a1
    assert acc.num_kept == 1 and not acc.is_full
    acc.add(*_round("b", [[-1, -1], [-1, 1], [1, 1]]))  # keeps b1
    acc.add(*_round("c", [[1, -1], [0.5, -1], [1, 0]]))  # keeps c0, c1, c2: 5 kept, 2 surplus
    assert acc.is_full
    items, rewards, metrics = acc.take()
    assert items == ["a1.0", "a1.1", "b1.0", "b1.1", "c0.0", "c0.1"]
    torch.testing.assert_close(rewards, torch.tensor([1, -1, -1, 1, 1, -1], dtype=torch.float64))
    assert metrics == {"generated": 9.0, "kept": 5.0, "rounds": 3.0, "keep_ratio": 5 / 9, "trimmed": 2.0}
    # Reset for the next batch.
    assert acc.num_kept == 0 and acc.metrics()["rounds"] == 0


def test_errors_after_the_bound_with_the_numbers_and_the_setting():
    acc = DynamicSamplingAccumulator(train_batch_size=4, group_size=2, max_num_gen_batches=2)
    acc.add(*_round("a", [[1, 1], [1, -1]]))
    with pytest.raises(DynamicSamplingExhausted) as info:
        acc.add(*_round("b", [[1, 1], [-1, -1]]))
    message = str(info.value)
    assert "after 2 generation rounds" in message
    assert "4 groups were generated and 1 kept (keep ratio 25.0%)" in message
    assert "data.train_batch_size=4" in message
    assert "algorithm.max_num_gen_batches" in message and "data.gen_batch_size" in message


def test_unlimited_rounds_and_filtering_off():
    acc = DynamicSamplingAccumulator(train_batch_size=2, group_size=2, max_num_gen_batches=0)
    for _ in range(50):
        acc.add(*_round("x", [[1, 1]]))
    assert acc.metrics()["rounds"] == 50 and not acc.is_full
    keep_all = DynamicSamplingAccumulator(train_batch_size=2, group_size=2, filter_groups=False)
    keep_all.add(*_round("y", [[1, 1], [-1, -1], [1, -1]]))
    items, _, metrics = keep_all.take()
    assert items == ["y0.0", "y0.1", "y1.0", "y1.1"] and metrics["trimmed"] == 1.0


def test_bad_input():
    acc = DynamicSamplingAccumulator(train_batch_size=2, group_size=3)
    with pytest.raises(ValueError, match=r"items has 2 entries but rewards has shape \(3,\)"):
        acc.add(["a", "b"], [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"rewards has shape \(4,\), not a whole number of groups of group_size=3"):
        acc.add(["a", "b", "c", "d"], [1.0, 0.0, 1.0, 0.0])
    with pytest.raises(RuntimeError, match="take\\(\\) before the batch is full: 0 of 2"):
        acc.take()
    with pytest.raises(ValueError, match="max_num_gen_batches=-1 must be >= 0"):
        DynamicSamplingAccumulator(train_batch_size=2, group_size=3, max_num_gen_batches=-1)
