"""Mismatch metrics and the TIS/MIS corrections against float64 references written out here."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_megatron.algo.loss import dapo_policy_loss
from dapo_megatron.algo.rollout_correction import correction_weights, mismatch_metrics

CAP = 1.5


def _case():
    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 7)
    for row, (start, length) in enumerate([(1, 5), (2, 3), (0, 6), (3, 4)]):
        mask[row, start : start + length] = 1
    old = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 2
    rollout = old + 0.5 * torch.randn(4, 7, generator=gen, dtype=torch.float64)
    log_probs = (old + 0.2 * torch.randn(4, 7, generator=gen, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)
    return mask, old, rollout, log_probs, advantages


def _reference_weight(old, rollout, mask, row, t, correction, level):
    """One token's weight, by hand: products as products, no log-space tricks."""
    if level == "token":
        ratio = math.exp(old[row][t] - rollout[row][t])
    else:
        ratio = 1.0
        for u in range(len(mask[row])):
            if mask[row][u]:
                ratio *= math.exp(old[row][u] - rollout[row][u])
    if correction == "tis":
        return min(ratio, CAP)
    return 1.0 if 1 / CAP <= ratio <= CAP else 0.0


def _reference_loss(log_probs, old, advantages, mask, weight_of):
    """DAPO's token mean over all loss tokens (before masking), each token weighted."""
    total, count = 0.0, 0
    for row in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[row, t]:
                continue
            ratio = torch.exp(log_probs[row, t] - old[row, t])
            a = advantages[row]
            token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28))
            total = total + weight_of(row, t) * token
            count += 1
    return total / count


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_corrected_loss_and_gradient_equal_a_float64_reference(correction, level):
    mask, old, rollout, log_probs, advantages = _case()
    weights, metrics = correction_weights(old, rollout, mask, correction, level, CAP)
    assert weights.dtype == torch.float32 and bool((weights[mask == 0] == 0).all())
    loss, _ = dapo_policy_loss(log_probs, old, advantages, mask, token_weights=weights.double())
    (grad,) = torch.autograd.grad(loss, log_probs)

    def weight_of(row, t):
        return _reference_weight(old.tolist(), rollout.tolist(), mask.tolist(), row, t, correction, level)

    expected = _reference_loss(log_probs, old, advantages, mask, weight_of)
    (expected_grad,) = torch.autograd.grad(expected, log_probs)
    # float32 weights: the only rounding, 6e-8 relative.
    assert abs(loss.item() - expected.item()) <= 1e-6 * abs(expected.item())
    assert torch.allclose(grad, expected_grad, rtol=1e-6, atol=1e-9)
    hand = [weight_of(r, t) for r in range(4) for t in range(7) if mask[r, t]]
    assert metrics["weight_mean"] == pytest.approx(sum(hand) / len(hand), rel=1e-6)
    assert metrics["masked_share"] == pytest.approx(sum(w == 0 for w in hand) / len(hand))
    # The case exercises the correction: TIS caps some weights, MIS drops some tokens and keeps others.
    if correction == "tis":
        assert any(w == CAP for w in hand) and any(w < 1 for w in hand)
    else:
        assert 0 < metrics["masked_share"] < 1
    # Negative control: the uncorrected loss differs, and so does MIS's with the kept
    # tokens as denominator (the wrong count) -- the test sees both mistakes.
    plain, _ = dapo_policy_loss(log_probs, old, advantages, mask)
    assert abs(plain.item() - expected.item()) > 1e-4
    if correction == "mis":
        kept = sum(w > 0 for w in hand)
        assert abs(expected.item() * len(hand) / kept - expected.item()) > 1e-4


def test_mismatch_metrics_equal_a_float64_reference():
    mask, old, rollout, _, _ = _case()
    metrics = mismatch_metrics(old.float(), rollout.float(), mask, CAP)
    k3, seq, outside = [], [], 0
    for row in range(4):
        total = 0.0
        for t in range(7):
            if mask[row, t]:
                d = float(old[row, t] - rollout[row, t])
                k3.append(math.exp(d) - 1 - d)
                total += d
                outside += abs(d) > math.log(CAP)
        seq.append(total)
    assert metrics["kl_k3_mean"] == pytest.approx(sum(k3) / len(k3), rel=1e-5)
    assert metrics["kl_k3_max"] == pytest.approx(max(k3), rel=1e-5)
    assert metrics["seq_log_ratio_mean"] == pytest.approx(sum(seq) / 4, rel=1e-5)
    assert metrics["seq_log_ratio_min"] == pytest.approx(min(seq), rel=1e-5)
    assert metrics["seq_log_ratio_max"] == pytest.approx(max(seq), rel=1e-5)
    assert metrics["ratio_outside_cap_share"] == outside / len(k3) and 0 < outside < len(k3)
    # Identical policies: no mismatch at all.
    same = mismatch_metrics(old, old, mask, CAP)
    assert same["kl_k3_mean"] == same["kl_k3_max"] == same["ratio_outside_cap_share"] == 0.0


def test_a_sequence_ratio_beyond_float_range_does_not_overflow():
    mask = torch.ones(1, 200)
    old, rollout = torch.zeros(1, 200), torch.full((1, 200), -5.0)  # product e^1000
    weights, _ = correction_weights(old, rollout, mask, "tis", "sequence", CAP)
    assert torch.all(weights == torch.tensor(CAP, dtype=torch.float32))
    weights, metrics = correction_weights(old, rollout, mask, "mis", "sequence", CAP)
    assert metrics["masked_share"] == 1.0 and not bool(weights.any())
