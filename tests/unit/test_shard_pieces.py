"""Each tensor-parallel rank's shard as pieces of the HF tensors: reassembled, they are the model."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.ckpt.mapping import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT_LAYER,
    ModelShape,
    hf_names_of,
    megatron_layer_key,
    shard_to_hf_pieces,
    to_hf,
)

SHAPE = ModelShape(
    num_layers=1,
    hidden_size=16,
    ffn_hidden_size=24,
    num_attention_heads=4,
    num_query_groups=4,
    vocab_size=13,
    tie_word_embeddings=False,
)
PADDED_VOCAB = 16
# Megatron key -> (global shape, partition dim or None)
TENSORS = {
    megatron_layer_key("self_attention.linear_qkv.weight"): ((4 * 3 * 4, 16), 0),
    megatron_layer_key("self_attention.linear_qkv.bias"): ((4 * 3 * 4,), 0),
    megatron_layer_key("self_attention.linear_proj.weight"): ((16, 16), 1),
    megatron_layer_key("mlp.linear_fc1.weight"): ((48, 16), 0),
    megatron_layer_key("mlp.linear_fc2.weight"): ((16, 24), 1),
    megatron_layer_key("self_attention.linear_qkv.layer_norm_weight"): ((16,), None),
    EMBEDDING: ((PADDED_VOCAB, 16), 0),
    OUTPUT_LAYER: ((PADDED_VOCAB, 16), 0),
    FINAL_NORM: ((16,), None),
}


def _shard(key: str, full: torch.Tensor, dim, rank: int, tp: int) -> torch.Tensor:
    if dim is None:
        return full
    if key.endswith("linear_fc1.weight"):  # megatron's shard r is [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp)[rank], torch.chunk(up, tp)[rank]])
    return torch.chunk(full, tp, dim=dim)[rank].contiguous()  # a rank holds its shard contiguously


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pieces_of_every_rank_reassemble_the_hf_tensors(tp):
    gen = torch.Generator().manual_seed(0)
    for key, (shape, dim) in TENSORS.items():
        layer = 0 if key.startswith("decoder.layers.") else None
        full = torch.randn(shape, generator=gen)
        if key in (EMBEDDING, OUTPUT_LAYER):
            full[SHAPE.vocab_size :] = float("nan")  # padding must never be sent
        expected = to_hf(key, full, SHAPE, layer)
        rebuilt = {name: torch.full_like(t, float("inf")) for name, t in expected.items()}
        filled = dict.fromkeys(expected, 0)
        for rank in range(tp):
            shard = _shard(key, full, dim, rank, tp)
            for name, piece, offset in shard_to_hf_pieces(key, shard, SHAPE, layer, rank, tp):
                assert piece.data_ptr() >= shard.data_ptr()  # a view of the shard: nothing copied
                assert piece.is_contiguous()
                target = rebuilt[name]
                for d, (start, size) in enumerate(zip(offset, piece.shape)):
                    target = target.narrow(d, start, size)
                target.copy_(piece)
                filled[name] += piece.numel()
        assert set(rebuilt) == set(hf_names_of(key, layer))
        for name, tensor in expected.items():
            assert filled[name] == tensor.numel(), (key, name, tp)  # every element exactly once
            assert torch.equal(rebuilt[name], tensor), (key, name, tp)
