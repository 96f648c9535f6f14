"""The model-FLOP formula (the numerator of MFU) against a hand count and torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.bench.flops import decode_flops, forward_flops, linear_shapes, train_flops
from dapo_megatron.ckpt.mapping import ModelShape


def test_forward_flops_match_a_hand_count():
    # 2 layers, h 8, 2 heads of d 4, 1 KV group, ffn 16, vocab 10; one 3-token sequence,
    # logits at 2 tokens. Per token per layer: q,k,v 2*8*(8+4+4) = 256; o 2*8*8 = 128;
    # gate+up 2*8*32 = 512; down 2*16*8 = 256; total 1152, x 3 tokens = 3456.
    # Attention: 2 matmuls x 2 FLOPs x d 4 x 2 heads x pairs: causal 6 pairs -> 192,
    # full 9 pairs -> 288. Output layer: 2 * 2 tokens * 8 * 10 = 320.
    shape = ModelShape(2, 8, 16, 2, 1, 10, tie_word_embeddings=False)
    assert forward_flops(shape, [3], 2) == 2 * (3456 + 192) + 320 == 7616
    assert forward_flops(shape, [3], 2, causal=False) == 2 * (3456 + 288) + 320 == 7808
    assert train_flops(shape, [3], 2) == 3 * 7616
    # Two sequences count separately: attention does not cross them.
    assert forward_flops(shape, [3, 3], 4) == 2 * 7616
    assert forward_flops(shape, [6], 4) != 2 * 7616
    # Generating 2 tokens after a 2-token prompt: 3 tokens pass through the layers, logits at 2.
    assert decode_flops(shape, 2, 2) == 7616
    assert decode_flops(shape, 2, 0) == 0
    # The ceiling's GEMMs are the per-token projections: 2 x tokens x their sizes is the count.
    per_token = sum(2 * n_in * n_out for n_in, n_out in linear_shapes(shape)[:-1])
    assert per_token == 1152 and linear_shapes(shape, 2)[0] == (8, 8)


@pytest.mark.parametrize("tied", [False, True])
def test_forward_and_backward_flops_equal_torchs_count_of_transformers_qwen2(tied):
    """transformers' eager attention computes the full square and masks it: the count
    with ``causal=False`` must equal what torch's FLOP counter sees, forward and
    forward + backward (three forwards), with GQA (4 heads, 2 groups)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    model = Qwen2ForCausalLM(config)
    batch, length = 3, 7
    ids = torch.randint(0, 40, (batch, length), generator=torch.Generator().manual_seed(0))
    shape = ModelShape(2, 32, 48, 4, 2, 40, tied)
    expected = forward_flops(shape, [length] * batch, batch * length, causal=False)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids)
    assert counter.get_total_flops() == expected
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.sum().backward()
    assert counter.get_total_flops() == train_flops(shape, [length] * batch, batch * length, causal=False)
    # The causal count is smaller by exactly the masked half of the square (less the diagonal).
    masked_pairs = batch * (length * length - length * (length + 1) // 2)
    assert expected - forward_flops(shape, [length] * batch, batch * length) == 2 * 2 * 2 * 8 * 4 * masked_pairs


def test_moe_flops_count_the_active_experts_as_torch_counts_transformers_qwen3_moe():
    """With eager experts, transformers runs each token through its top-k experts only:
    torch's FLOP counter sees exactly the active-parameter count (k experts and the router
    per token), forward and forward + backward."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM._from_config(config, attn_implementation="eager", experts_implementation="eager")
    batch, length = 3, 7
    ids = torch.randint(0, 40, (batch, length), generator=torch.Generator().manual_seed(0))
    shape = ModelShape(
        2,
        32,
        48,
        4,
        2,
        40,
        False,
        head_dim=16,
        qkv_bias=False,
        qk_norm=True,
        num_experts=4,
        moe_ffn_hidden_size=24,
        moe_router_topk=2,
    )
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids)
    assert counter.get_total_flops() == forward_flops(shape, [length] * batch, batch * length, causal=False)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.sum().backward()
    assert counter.get_total_flops() == train_flops(shape, [length] * batch, batch * length, causal=False)
    # The experts' share: k of the E experts' (2 of 4), plus the router's 2 h E per token.
    dense = ModelShape(2, 32, 2 * 24, 4, 2, 40, False, head_dim=16, qkv_bias=False, qk_norm=True)
    router = 2 * 2 * 32 * 4 * batch * length
    assert forward_flops(shape, [length] * batch, 0) == forward_flops(dense, [length] * batch, 0) + router
