"""Load model weights from a megatron dist checkpoint into a GPTModel of any layout.

megatron's own ``dist_checkpointing.load`` does the resharding; this adds what a
checkpoint converted from HF (or written at another tensor-parallel size) needs: the
``_extra_state`` entries (Transformer Engine's fp8 bookkeeping, no weights) are not
requested, and the vocabulary-sized tensors load with a shape mismatch allowed (megatron
marks them so), zero-filling this layout's padding rows.
"""

from __future__ import annotations

import os


def _drop_extra_state(sharded: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {
        key: value
        for key, value in sharded.items()
        if not (isinstance(value, ShardedObject) and key.endswith("_extra_state"))
    }


def load_megatron_weights(gpt, path: str | os.PathLike) -> None:
    """Load ``gpt``'s parameters (this rank's shards) from the dist checkpoint at ``path``."""
    from megatron.core import dist_checkpointing

    sharded = _drop_extra_state(gpt.sharded_state_dict(prefix=""))
    loaded = dist_checkpointing.load(sharded, str(path))
    # A trainer checkpoint also holds optimizer, scheduler and step (its common state,
    # which load() returns with the model): keep the model's tensors only.
    loaded = {key: value for key, value in loaded.items() if key in sharded}
    missing, unexpected = gpt.load_state_dict(loaded, strict=False)
    missing = [key for key in missing if not key.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} did not fill the model: missing {missing}, unexpected {unexpected}")


def load_hf_weights(
    gpt, hf_dir: str | os.PathLike, shape, tp_rank: int, tp_size: int, ep_rank: int = 0, ep_size: int = 1
) -> None:
    """Load ``gpt``'s parameters (this rank's shards) straight from an HF safetensors folder.

    Converted on load, tensor by tensor, through the converter's mapping: no Megatron copy
    of the checkpoint is written. Each full Megatron tensor is built from its HF tensors
    and this tensor-parallel rank's slice is copied into the parameter (``linear_fc1`` as
    ``[gate_r; up_r]``, vocabulary rows zero-padded to the layout's padded size). A local
    expert reads only its own expert: the ``j``-th of expert-parallel rank ``ep_rank`` is
    expert ``ep_rank * num_experts / ep_size + j``.
    """
    import torch

    from dapo_megatron.ckpt.hf_checkpoint import HFCheckpoint
    from dapo_megatron.ckpt.mapping import (
        EMBEDDING,
        FINAL_NORM,
        OUTPUT_LAYER,
        VOCAB_KEYS,
        canonical_layer_param,
        hf_names_of,
        megatron_layer_key,
        to_megatron,
    )
    from dapo_megatron.models.gpt import local_expert_of

    checkpoint = HFCheckpoint(hf_dir)
    checkpoint.check_against(shape)
    layer_numbers = {f"decoder.layers.{i}.": layer.layer_number - 1 for i, layer in enumerate(gpt.decoder.layers)}
    local_experts = shape.num_experts // ep_size
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            experts = None
            if name.startswith("decoder.layers."):
                prefix = name[: name.index(".", len("decoder.layers.")) + 1]
                expert = local_expert_of(name[len(prefix) :])
                if expert is not None:
                    key, layer = megatron_layer_key(expert[0]), layer_numbers[prefix]
                    experts = [ep_rank * local_experts + expert[1]]
                    full = to_megatron(
                        key, [checkpoint.read(n) for n in hf_names_of(key, layer, experts=experts)], shape
                    )
                    _copy_checked(param, full[0], hf_dir, key, layer, name)
                    continue
                key, layer = megatron_layer_key(canonical_layer_param(name[len(prefix) :])), layer_numbers[prefix]
            else:
                key = {
                    "embedding.word_embeddings.weight": EMBEDDING,
                    "decoder.final_layernorm.weight": FINAL_NORM,
                    # Tied embeddings under pipeline parallelism: the last stage keeps its own
                    # copy of the embedding as the output layer (megatron keeps them equal).
                    "output_layer.weight": EMBEDDING if shape.tie_word_embeddings else OUTPUT_LAYER,
                }[name]
                layer = None
            full = to_megatron(key, [checkpoint.read(n) for n in hf_names_of(key, layer)], shape)
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                dim = param.partition_dim
                if key in VOCAB_KEYS:
                    padded = full.new_zeros((param.shape[0] * tp_size, *full.shape[1:]))
                    padded[: full.shape[0]] = full
                    full = padded
                if key.endswith("linear_fc1.weight"):
                    gate, up = (torch.chunk(half, tp_size, dim=0)[tp_rank] for half in torch.chunk(full, 2, dim=0))
                    local = torch.cat([gate, up], dim=0)
                else:
                    local = torch.chunk(full, tp_size, dim=dim)[tp_rank]
            elif key in VOCAB_KEYS:
                local = full.new_zeros(param.shape)
                local[: full.shape[0]] = full
            else:
                local = full
            _copy_checked(param, local, hf_dir, key, layer, name)


def _copy_checked(param, local, hf_dir, key: str, layer, name: str) -> None:
    if tuple(local.shape) != tuple(param.shape):
        raise ValueError(
            f"{hf_dir}: {key} (layer {layer}) gives a shard of shape {tuple(local.shape)} for parameter "
            f"{name} of shape {tuple(param.shape)}"
        )
    param.copy_(local)
