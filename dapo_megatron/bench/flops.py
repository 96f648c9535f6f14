"""Model FLOPs of a decoder of any supported family: the numerator of MFU.

MFU is only comparable between systems when everyone counts the same operations, so the
count is written out here once and documented in ``docs/performance.md``. It counts the
matrix multiplications a forward pass must do (2 FLOPs per multiply-add); norms,
RoPE, softmax, biases and activations are elementwise and left out, as is any
recomputation (the chunked log-prob recomputes its logits in backward; that work is
real but not *model* FLOPs, so it lowers MFU instead of raising it).

For a sequence of ``L`` tokens, hidden ``h``, ``a`` query heads and ``g`` key/value
groups of head width ``d`` (``head_dim``; ``h / a`` in Qwen2), MLP width ``f``, vocabulary ``V`` and ``n`` tokens
whose next-token distribution is computed (the actor computes logits only at loss
tokens; generation at every sampled token):

    per layer:  2 L h (a d + 2 g d)      q, k, v projections
              + 2 L (a d) h              output projection
              + 2 * 2 d a P              scores Q K^T and weights x V, P query-key pairs
              + 2 L h (2 f) + 2 L f h    SwiGLU: gate and up, then down
    output:     2 n h V

A mixture-of-experts layer (Qwen3-MoE: ``E`` experts of width ``f_e``, top ``k``) counts
the **active** parameters: each token goes through ``k`` experts, and the router scores
it against all of them, so its MLP term is ``k (2 L h (2 f_e) + 2 L f_e h) + 2 L h E``.

``P = L (L + 1) / 2`` with causal attention (the pairs a causal kernel must compute);
``P = L^2`` counts the full square that an unfused kernel computes and masks (what
``torch``'s FLOP counter sees in transformers' eager attention). Backward costs twice
the forward (gradients of both the inputs and the weights), so a training pass is three
forward passes.
"""

from __future__ import annotations

from collections.abc import Iterable

from dapo_megatron.ckpt.mapping import ModelShape, has_experts


def linear_shapes(shape: ModelShape, tp_size: int = 1) -> list[tuple[int, int]]:
    """``(in_features, out_features)`` of one layer's projections as one tensor-parallel
    rank holds them (q/k/v, output projection, gate/up, down), then the output layer."""
    h, d = shape.hidden_size, shape.head_dim
    a, g, f = shape.num_attention_heads, shape.num_query_groups, shape.ffn_hidden_size
    attention = [
        (h, (a + 2 * g) * d // tp_size),  # fused q, k, v (column parallel)
        (a * d // tp_size, h),  # output projection (row parallel)
    ]
    if shape.num_experts:  # one expert (whole on its rank: expert-tensor-parallel 1), and the router
        mlp = [(h, 2 * shape.moe_ffn_hidden_size), (shape.moe_ffn_hidden_size, h), (h, shape.num_experts)]
    else:
        mlp = [(h, 2 * f // tp_size), (f // tp_size, h)]  # gate and up (column parallel), down (row parallel)
    return [*attention, *mlp, (h, shape.vocab_size // tp_size)]  # then the output layer (vocabulary parallel)


def mlp_flops_per_token(shape: ModelShape, layer: int = 0) -> int:
    """Layer ``layer``'s MLP FLOPs for one token: the SwiGLU, or the top-k experts' and
    the router's."""
    h = shape.hidden_size
    if has_experts(shape, layer):
        f = shape.moe_ffn_hidden_size
        return shape.moe_router_topk * (2 * h * (2 * f) + 2 * f * h) + 2 * h * shape.num_experts
    f = shape.ffn_hidden_size
    return 2 * h * (2 * f) + 2 * f * h


def attention_pairs(length: int, causal: bool = True) -> int:
    """Query-key pairs one attention head computes for a sequence of ``length`` tokens."""
    return length * (length + 1) // 2 if causal else length * length


def forward_flops(shape: ModelShape, seq_lengths: Iterable[int], logit_tokens: int, *, causal: bool = True) -> int:
    """Model FLOPs of one forward pass over sequences of ``seq_lengths`` tokens with
    next-token distributions at ``logit_tokens`` of them (see the module docstring)."""
    h, d = shape.hidden_size, shape.head_dim
    a, g = shape.num_attention_heads, shape.num_query_groups
    tokens = pairs = 0
    for length in seq_lengths:
        tokens += length
        pairs += attention_pairs(length, causal)
    per_token = 2 * h * (a * d + 2 * g * d) + 2 * (a * d) * h
    mlp = sum(mlp_flops_per_token(shape, layer) for layer in range(shape.num_layers))
    attention = 2 * 2 * d * a * pairs
    return shape.num_layers * (tokens * per_token + attention) + tokens * mlp + 2 * logit_tokens * h * shape.vocab_size


def train_flops(shape: ModelShape, seq_lengths: Iterable[int], logit_tokens: int, *, causal: bool = True) -> int:
    """Model FLOPs of a forward and backward pass (three forwards' worth)."""
    return 3 * forward_flops(shape, seq_lengths, logit_tokens, causal=causal)


def decode_flops(shape: ModelShape, prompt_length: int, response_length: int) -> int:
    """Model FLOPs of generating ``response_length`` tokens after a ``prompt_length``-token
    prompt with a KV cache: the prompt's forward, then each new token attends to every
    token before it and itself; a distribution at every sampled position (the last
    prompt token's and each response token's but the last)."""
    if response_length <= 0:
        return 0
    total = prompt_length + response_length - 1  # tokens that pass through the layers
    # Token t (0-based) attends to t + 1 keys either way: the causal count of the whole.
    return forward_flops(shape, [total], response_length, causal=True)
