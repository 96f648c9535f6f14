"""DAPO loss, advantages and overlong shaping: hand-computed values and the invariants."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_megatron.algo import dapo_policy_loss, group_advantages, overlong_filter_mask, overlong_penalty


def _batch(ratios, advantages, mask=None, dtype=torch.float64):
    log_probs = torch.log(torch.tensor(ratios, dtype=dtype)).requires_grad_(True)
    old = torch.zeros_like(log_probs)
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=dtype)
    return log_probs, old, torch.tensor(advantages, dtype=dtype), mask


def test_token_mean_by_hand_with_both_clip_bounds():
    # Row 0 has A=+1: ratio 1.5 is clipped at 1.28; ratio 0.5 is not (pessimistic min).
    # Row 1 has A=-1: ratio 1.1 is not clipped; ratio 0.7 is clipped at 0.8.
    log_probs, old, adv, mask = _batch([[1.5, 0.5], [1.1, 0.7]], [1.0, -1.0])
    loss, metrics = dapo_policy_loss(log_probs, old, adv, mask)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.1 + 0.8) / 4, abs=1e-12)
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(0.25)
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(0.25)
    assert metrics["pg_clipfrac_dual"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    expected_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.7)) / 4
    assert metrics["approx_kl"].item() == pytest.approx(expected_kl)
    assert metrics["num_tokens"].item() == 4
    loss.backward()
    # d/dlogp of -A*r is -A*r for unclipped tokens; clipped tokens get no gradient.
    expected = torch.tensor([[0.0, -0.5], [1.1, 0.0]], dtype=torch.float64) / 4
    torch.testing.assert_close(log_probs.grad, expected, rtol=0, atol=1e-12)


def test_clip_bounds_are_decoupled():
    # ratio 1.25 with A>0 is inside [0.8, 1.28]: unclipped with clip-higher, clipped at 1.2 without.
    log_probs, old, adv, mask = _batch([[1.25]], [2.0])
    higher, m1 = dapo_policy_loss(log_probs, old, adv, mask)
    symmetric, m2 = dapo_policy_loss(log_probs, old, adv, mask, clip_ratio_high=0.2)
    assert higher.item() == pytest.approx(-2.5) and m1["pg_clipfrac_high"].item() == 0.0
    assert symmetric.item() == pytest.approx(-2.4) and m2["pg_clipfrac_high"].item() == 1.0


def test_dual_clip_caps_negative_advantages():
    log_probs, old, adv, mask = _batch([[4.0, 2.0], [4.0, 0.1]], [-1.0, 1.0])
    loss, metrics = dapo_policy_loss(log_probs, old, adv, mask, clip_ratio_c=3.0)
    # Row 0 (A=-1): ratio 4 -> min(max(4, 1.28), 3) = 3 (dual clip); ratio 2 -> 2.
    # Row 1 (A=+1): ratio 4 -> -1.28 (upper clip); ratio 0.1 -> -0.1 (dual clip is for A<0 only).
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.28 - 0.1) / 4)
    assert metrics["pg_clipfrac_dual"].item() == pytest.approx(0.25)
    loss.backward()
    expected = torch.tensor([[0.0, 2.0], [0.0, -0.1]], dtype=torch.float64) / 4
    torch.testing.assert_close(log_probs.grad, expected, rtol=0, atol=1e-12)
    without, _ = dapo_policy_loss(log_probs.detach(), old, adv, mask)
    assert without.item() == pytest.approx((4.0 + 2.0 - 1.28 - 0.1) / 4)


def test_masked_positions_are_ignored_even_if_nan():
    log_probs, old, adv, mask = _batch([[1.5, 1.0, 1.0], [1.1, 0.7, 1.0]], [1.0, -1.0], [[1, 0, 0], [1, 1, 0]])
    padded = log_probs.detach().clone()
    padded[:, 2] = float("nan")
    padded.requires_grad_(True)
    loss, metrics = dapo_policy_loss(padded, old, adv, mask)
    assert loss.item() == pytest.approx((-1.28 + 1.1 + 0.8) / 3)
    assert metrics["num_tokens"].item() == 3
    loss.backward()
    assert torch.isfinite(padded.grad).all()


def test_seq_mean_modes_by_hand():
    # Row 0: one token, loss -1.0 (A=1, r=1); row 1: two tokens, losses 1.1 and 0.8 (A=-1).
    log_probs, old, adv, mask = _batch([[1.0, 1.0], [1.1, 0.7]], [1.0, -1.0], [[1, 0], [1, 1]])
    token_mean, _ = dapo_policy_loss(log_probs, old, adv, mask)
    seq_mean, _ = dapo_policy_loss(log_probs, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    seq_sum, _ = dapo_policy_loss(log_probs, old, adv, mask, loss_agg_mode="seq-mean-token-sum")
    assert token_mean.item() == pytest.approx((-1.0 + 1.1 + 0.8) / 3)
    assert seq_mean.item() == pytest.approx((-1.0 + (1.1 + 0.8) / 2) / 2)
    assert seq_sum.item() == pytest.approx((-1.0 + (1.1 + 0.8)) / 2)


def _random_batch(seed, batch=8, seq=12, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 12, 3, 7, 12, 2, 9, 5])[:batch]
    mask = (torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)
    old = -torch.rand(batch, seq, generator=gen, dtype=dtype) * 3
    log_probs = (old + 0.4 * torch.randn(batch, seq, generator=gen, dtype=dtype)).requires_grad_(True)
    adv = torch.randn(batch, generator=gen, dtype=dtype)
    return log_probs, old, adv, mask


def test_micro_batches_with_global_token_count_equal_the_whole_batch():
    log_probs, old, adv, mask = _random_batch(0)
    whole, _ = dapo_policy_loss(log_probs, old, adv, mask)
    (whole_grad,) = torch.autograd.grad(whole, log_probs)

    total = int(mask.sum())
    pieces = [slice(0, 3), slice(3, 4), slice(4, 8)]
    summed = sum(dapo_policy_loss(log_probs[p], old[p], adv[p], mask[p], global_num_tokens=total)[0] for p in pieces)
    (summed_grad,) = torch.autograd.grad(summed, log_probs)
    assert summed.item() == pytest.approx(whole.item(), rel=1e-14, abs=1e-15)
    torch.testing.assert_close(summed_grad, whole_grad, rtol=1e-13, atol=1e-15)

    # The mistake this guards against: each micro-batch divided by its own token count.
    wrong = sum(dapo_policy_loss(log_probs[p], old[p], adv[p], mask[p])[0] for p in pieces) / len(pieces)
    assert abs(wrong.item() - whole.item()) > 1e-3


def test_seq_mean_token_mean_reproduces_grpo_objective():
    eps = 0.2
    log_probs, old, adv, mask = _random_batch(1)
    loss, _ = dapo_policy_loss(
        log_probs, old, adv, mask, clip_ratio_low=eps, clip_ratio_high=eps, loss_agg_mode="seq-mean-token-mean"
    )
    (grad,) = torch.autograd.grad(loss, log_probs)

    # GRPO: J = 1/G sum_i 1/|o_i| sum_t min(r A, clip(r, 1-eps, 1+eps) A), written as loops.
    reference_input = log_probs.detach().clone().requires_grad_(True)
    objective = 0.0
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        terms = []
        for t in range(n):
            r = torch.exp(reference_input[i, t] - old[i, t])
            terms.append(torch.minimum(r * adv[i], torch.clamp(r, 1 - eps, 1 + eps) * adv[i]))
        objective = objective + torch.stack(terms).sum() / n
    reference = -objective / mask.shape[0]
    (reference_grad,) = torch.autograd.grad(reference, reference_input)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-10, atol=1e-14)


def test_loss_bad_input():
    log_probs, old, adv, mask = _random_batch(2)
    with pytest.raises(ValueError, match=r"old_log_probs has shape \(8, 11\) but log_probs has shape \(8, 12\)"):
        dapo_policy_loss(log_probs, old[:, :11], adv, mask)
    with pytest.raises(ValueError, match=r"advantages has shape \(7,\) but log_probs has shape \(8, 12\)"):
        dapo_policy_loss(log_probs, old, adv[:7], mask)
    with pytest.raises(ValueError, match=r"log_probs must have shape \[batch, seq\], got shape \(96,\)"):
        dapo_policy_loss(log_probs.reshape(-1), old.reshape(-1), adv, mask.reshape(-1))
    bad = log_probs.detach().clone()
    bad[3, 0] = float("inf")
    with pytest.raises(
        ValueError, match=r"log_probs \(shape \(8, 12\)\) has 1 NaN/Inf values at response tokens, in rows \[3\]"
    ):
        dapo_policy_loss(bad, old, adv, mask)
    bad_old = old.clone()
    bad_old[1, 5] = float("nan")
    with pytest.raises(ValueError, match="old_log_probs"):
        dapo_policy_loss(log_probs, bad_old, adv, mask)
    with pytest.raises(ValueError, match=r"response_mask \(shape \(8, 12\)\) selects no response tokens"):
        dapo_policy_loss(log_probs, old, adv, torch.zeros_like(mask))
    # An empty piece of a larger batch is fine when the global count is given.
    empty, _ = dapo_policy_loss(log_probs, old, adv, torch.zeros_like(mask), global_num_tokens=10)
    assert empty.item() == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode='mean' is not one of"):
        dapo_policy_loss(log_probs, old, adv, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="clip_ratio_c=0.5 must be > 1"):
        dapo_policy_loss(log_probs, old, adv, mask, clip_ratio_c=0.5)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4, eps=1e-6)
    # Group 0: mean -0.5, unbiased std sqrt((1.5^2 + 3 * 0.5^2) / 3) = 1.
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]) / (1 + 1e-6)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)
    two = group_advantages(torch.tensor([3.0, 1.0]), group_size=2, eps=0.0)
    # mean 2, unbiased std sqrt(2): (+-1) / sqrt(2)
    torch.testing.assert_close(two, torch.tensor([1.0, -1.0]) / math.sqrt(2))


def test_group_advantages_bad_input():
    with pytest.raises(
        ValueError, match=r"rewards has shape \(7,\), which is not a whole number of groups of group_size=4"
    ):
        group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match=r"rewards must be a 1-D tensor"):
        group_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="NaN or Inf"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    penalty = overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=4)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = overlong_penalty(lengths, 20, 4, penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match=r"overlong_buffer_len=30 must be in \(0, max_response_length=20\]"):
        overlong_penalty(lengths, 20, 30)
    with pytest.raises(ValueError, match="response_lengths must be a 1-D tensor"):
        overlong_penalty(lengths.reshape(2, 3), 20, 4)


def test_overlong_filter_mask_drops_truncated_rows():
    mask = torch.ones(3, 4)
    filtered = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    torch.testing.assert_close(filtered, torch.tensor([[1.0] * 4, [0.0] * 4, [1.0] * 4]))
    with pytest.raises(ValueError, match=r"got \(3, 4\) and \(2,\)"):
        overlong_filter_mask(mask, torch.tensor([True, False]))


def test_tokens_beyond_the_log_ratio_bound_are_counted_and_get_no_gradient():
    # Token 0: A < 0 and a ratio of e^25 (no dual clip): the unclipped objective has a
    # gradient there, the bounded one does not. Token 1: an ordinary token.
    old = torch.tensor([[-30.0, -1.0]])
    new = torch.tensor([[-5.0, -1.1]], requires_grad=True)
    mask = torch.ones(1, 2)
    loss, metrics = dapo_policy_loss(new, old, torch.tensor([-1.0]), mask)
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] != 0
    assert float(metrics["log_ratio_clamped"]) == 0.5
    assert float(metrics["pg_clipfrac_low"]) == 0 and float(metrics["pg_clipfrac_high"]) == 0
    _, inside = dapo_policy_loss(new.detach(), old.clamp(min=-20.0), torch.tensor([-1.0]), mask)
    assert float(inside["log_ratio_clamped"]) == 0


def test_kl_estimators_and_their_place_in_the_loss():
    """k1, k3 and low_var_kl against their formulas in float64; the penalty joins the loss
    with the policy loss's denominator, unweighted by the rollout correction."""
    from dapo_megatron.algo.loss import kl_penalty

    log_p = torch.tensor([[-0.5, -2.0, -0.1, -30.0]], dtype=torch.float64)
    ref = torch.tensor([[-0.7, -1.0, -0.1, -1.0]], dtype=torch.float64)
    r = torch.exp(ref - log_p)
    assert torch.allclose(kl_penalty(log_p, ref, "k1"), log_p - ref)
    k3 = kl_penalty(log_p, ref, "k3")
    assert torch.allclose(k3[:, :3], (r - torch.log(r) - 1)[:, :3]) and bool((k3 >= 0).all())
    assert k3[0, 2] == 0  # equal policies: no penalty
    low = kl_penalty(log_p, ref, "low_var_kl")
    assert low[0, 3] == 10.0 and k3[0, 3] > 1e6  # one collapsed token cannot dominate
    with pytest.raises(ValueError, match="kl type 'k2' is not one of k1, k3, low_var_kl"):
        kl_penalty(log_p, ref, "k2")

    mask = torch.tensor([[0, 1, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    weights = torch.tensor([[1.0, 0.5, 0.5, 1.0]], dtype=torch.float64)
    base, _ = dapo_policy_loss(log_p, log_p, adv, mask, global_num_tokens=4, token_weights=weights)
    with_kl, m = dapo_policy_loss(
        log_p,
        log_p,
        adv,
        mask,
        global_num_tokens=4,
        token_weights=weights,
        ref_log_probs=ref,
        kl_coef=0.1,
        kl_type="k3",
    )
    expected_kl = (k3 * mask).sum() / 4  # the global denominator; weights do not touch it
    assert torch.allclose(with_kl - base, 0.1 * expected_kl)
    assert torch.allclose(m["kl_loss"], (k3 * mask).sum() / 2)  # per loss token of this batch
