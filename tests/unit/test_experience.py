"""Advantages by prompt identity, and the validation metrics avg@k / pass@k."""

from __future__ import annotations

import random

import torch

from dapo_megatron.algo import group_advantages, group_advantages_by_id
from dapo_megatron.config import AlgorithmConfig
from dapo_megatron.data import Prompt
from dapo_megatron.sampling.samples import Sample, build_policy_batch, validation_metrics


def _samples(num_prompts=4, n=4, seed=0):
    gen = random.Random(seed)
    samples = []
    for p in range(num_prompts):
        prompt = Prompt(p, tuple(range(1, 2 + p)), "7", "src" if p % 2 else "other", "x")
        for _ in range(n):
            s = Sample((0, p), prompt, [5] * gen.randint(1, 4), [], "stop", "", correct=gen.random() < 0.5)
            s.score = 1.0 if s.correct else -1.0
            samples.append(s)
    return samples


def test_shuffled_batch_gets_the_same_advantage_for_each_response():
    samples = _samples()
    algo = AlgorithmConfig(overlong_buffer_enable=False)
    ordered = build_policy_batch(samples, algo).advantages
    reference = group_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64), 4).float()
    assert torch.allclose(ordered, reference, atol=0, rtol=0)
    permutation = list(range(len(samples)))
    random.Random(1).shuffle(permutation)
    shuffled = build_policy_batch([samples[i] for i in permutation], algo).advantages
    assert torch.equal(shuffled, ordered[permutation])
    # Negative control: grouping the shuffled batch by position gets other advantages.
    positional = group_advantages(torch.tensor([samples[i].reward for i in permutation], dtype=torch.float64), 4)
    assert not torch.allclose(positional.float(), ordered[permutation])


def test_group_ids_of_unequal_groups_are_refused():
    try:
        group_advantages_by_id(torch.tensor([1.0, 0.0, 1.0]), ["a", "a", "b"])
    except ValueError as exc:
        assert "different sizes" in str(exc)
    else:
        raise AssertionError("expected a ValueError")


def test_validation_avg_and_pass_at_k_per_source():
    samples = _samples(num_prompts=4, n=4, seed=3)
    metrics = validation_metrics(samples, 4)
    correct = [s.correct for s in samples]
    assert metrics["val/accuracy"] == sum(correct) / 16
    solved = [any(correct[4 * p : 4 * p + 4]) for p in range(4)]
    assert metrics["val/pass_at_k"] == sum(solved) / 4
    assert metrics["val/src/num_problems"] == 2 and metrics["val/other/num_problems"] == 2
    src = [c for s, c in zip(samples, correct) if s.prompt.data_source == "src"]
    assert metrics["val/src/accuracy"] == sum(src) / 8


def test_groups_with_an_aborted_response_are_dropped_whole():
    from dapo_megatron.sampling.samples import drop_aborted_groups

    samples = _samples(num_prompts=3, n=4)
    samples[5].finish_reason = "abort"  # group (0, 1)
    kept, aborted = drop_aborted_groups(samples)
    assert aborted == 1
    assert [s.group_id for s in kept] == [(0, 0)] * 4 + [(0, 2)] * 4
    assert drop_aborted_groups(_samples(num_prompts=2)) == (_samples(num_prompts=2), 0)
