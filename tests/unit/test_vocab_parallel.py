"""Chunked log-prob/entropy against a float64 full-vocabulary reference (single rank)."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.actor.vocab_parallel import vocab_parallel_log_probs_and_entropy


def _reference(hidden, weight, targets, vocab_size, temperature=1.0):
    logits = (hidden.double() @ weight.double().t())[:, :vocab_size] / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


@pytest.mark.parametrize(("chunk", "temperature", "padded"), [(None, 1.0, 0), (7, 1.0, 24), (5, 0.7, 3)])
def test_values_and_gradients_match_float64(chunk, temperature, padded):
    gen = torch.Generator().manual_seed(0)
    vocab, hidden_size, tokens = 100, 16, 23
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_(True)
    weight = (torch.randn(vocab + padded, hidden_size, generator=gen) * 0.5).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    g_lp = torch.randn(tokens, generator=gen)
    g_ent = torch.randn(tokens, generator=gen)

    log_probs, entropy = vocab_parallel_log_probs_and_entropy(
        hidden, weight, targets, vocab_size=vocab, temperature=temperature, chunk_tokens=chunk
    )
    (log_probs * g_lp + entropy * g_ent).sum().backward()

    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref_lp, ref_ent = _reference(h64, w64, targets, vocab, temperature)
    (ref_lp * g_lp.double() + ref_ent * g_ent.double()).sum().backward()

    torch.testing.assert_close(log_probs.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)
    if padded:
        # Padded vocabulary rows get no probability, hence no gradient.
        assert torch.count_nonzero(weight.grad[vocab:]) == 0


def test_only_log_prob_gradient():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 8, generator=gen).requires_grad_(True)
    weight = torch.randn(30, 8, generator=gen)
    targets = torch.randint(0, 30, (9,), generator=gen)
    log_probs, _ = vocab_parallel_log_probs_and_entropy(hidden, weight, targets, vocab_size=30, chunk_tokens=4)
    log_probs.sum().backward()
    h64 = hidden.detach().double().requires_grad_(True)
    ref_lp, _ = _reference(h64, weight.double(), targets, 30)
    ref_lp.sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)


def test_bad_shapes():
    with pytest.raises(ValueError, match="shapes disagree"):
        vocab_parallel_log_probs_and_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2), vocab_size=5)
    with pytest.raises(ValueError, match="temperature=0 must be > 0"):
        vocab_parallel_log_probs_and_entropy(
            torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3), vocab_size=5, temperature=0
        )


def test_bf16_logits_keep_the_gemms_fp32_result():
    """bf16 hidden states and weight: each chunk's logits are the fp32 result of the
    products (within fp32 rounding of the float64 reference), not bf16-rounded logits,
    which are off by up to ~0.06 at magnitude 20 (the negative control)."""
    from dapo_megatron.actor.vocab_parallel import _chunk_logits

    torch.manual_seed(0)
    hidden = (torch.randn(64, 256) * 0.6).bfloat16()
    weight = (torch.randn(100, 256) * 0.6).bfloat16()
    reference = hidden.double() @ weight.double().t()
    assert reference.abs().max() > 15
    logits = _chunk_logits(hidden, weight, 1.0, torch.empty(64, 100))
    assert logits.dtype == torch.float32
    assert (logits.double() - reference).abs().max() < 1e-4
    rounded = torch.matmul(hidden, weight.t()).float()
    assert (rounded.double() - reference).abs().max() > 1e-2
    log_probs, _ = vocab_parallel_log_probs_and_entropy(hidden, weight, torch.arange(64) % 100, vocab_size=100)
    expected = torch.log_softmax(reference, -1)[torch.arange(64), torch.arange(64) % 100]
    assert (log_probs.double() - expected).abs().max() < 1e-4
