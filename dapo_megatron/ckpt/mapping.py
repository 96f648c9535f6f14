"""The one place that knows how HF names and layouts map to Megatron's, for every model
family (``dapo_megatron.models.families``): computed from the family's features, so a
family adds no code here.

Used by the checkpoint converter in both directions and by weight sync to the rollout
engines, so a layout mistake cannot hide in one of them. Megatron differs from HF in:

- **QKV** is one fused ``linear_qkv`` whose rows are interleaved per query group: for each
  of the ``num_query_groups`` groups, that group's query heads, then its key head, then
  its value head (``[q_1 .. q_k, k, v]`` per group). Biases (Qwen2) the same way.
- **q/k norms** (Qwen3): HF ``self_attn.q_norm`` / ``k_norm`` are megatron's
  ``self_attention.q_layernorm`` / ``k_layernorm``, ``[head_dim]`` each, unsharded.
- **SwiGLU** ``linear_fc1`` is ``[gate; up]`` (HF ``gate_proj`` then ``up_proj``).
- **Norms** live on the following linear: ``input_layernorm`` is
  ``linear_qkv.layer_norm_weight``, ``post_attention_layernorm`` is
  ``linear_fc1.layer_norm_weight``.
- **Layers** are stacked: Megatron's checkpoint stores ``decoder.layers.<name>`` as one
  tensor ``[num_layers, ...]``.
- **Vocabulary**: Megatron pads it to a multiple of ``divisor * tp``. Converted checkpoints
  store the HF rows only (Megatron's embedding and output layer load with a shape
  mismatch allowed, zero-filling padding); converting back strips any padding.
- **Tied embeddings**: no ``output_layer.weight`` and no ``lm_head.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dapo_megatron.models.families import DEFAULT_MODEL_TYPE, family_named

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
VOCAB_KEYS = (EMBEDDING, OUTPUT_LAYER)

QKV_BIAS = "self_attention.linear_qkv.bias"
QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")

# Megatron layer parameter -> HF names of layer i (filled with the index); those a family
# lacks are dropped by :func:`layer_params`.
_ALL_LAYER_PARAMS: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv.layer_norm_weight": ("model.layers.{i}.input_layernorm.weight",),
    "self_attention.linear_qkv.weight": (
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.v_proj.weight",
    ),
    QKV_BIAS: (
        "model.layers.{i}.self_attn.q_proj.bias",
        "model.layers.{i}.self_attn.k_proj.bias",
        "model.layers.{i}.self_attn.v_proj.bias",
    ),
    QK_NORMS[0]: ("model.layers.{i}.self_attn.q_norm.weight",),
    QK_NORMS[1]: ("model.layers.{i}.self_attn.k_norm.weight",),
    "self_attention.linear_proj.weight": ("model.layers.{i}.self_attn.o_proj.weight",),
    "mlp.linear_fc1.layer_norm_weight": ("model.layers.{i}.post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("model.layers.{i}.mlp.down_proj.weight",),
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions and features the mapping needs (from the HF config and the family)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: Optional[int] = None
    """Width of one head; ``hidden_size / num_attention_heads`` when not given."""
    qkv_bias: bool = True
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_model_config(cls, model) -> ModelShape:
        """From a resolved :class:`dapo_megatron.config.ModelConfig` (or a dict of its fields);
        the features come from its family."""
        get = model.get if isinstance(model, dict) else lambda name: getattr(model, name, None)
        family = family_named(get("family") or DEFAULT_MODEL_TYPE)
        fields = {name: get(name) for name in cls.__dataclass_fields__ if name not in ("qkv_bias", "qk_norm")}
        return cls(**fields, qkv_bias=family.qkv_bias, qk_norm=family.qk_norm)


def layer_params(shape: ModelShape) -> dict[str, tuple[str, ...]]:
    """Megatron layer parameter -> HF names of layer ``{i}``, for ``shape``'s family."""
    absent = set()
    if not shape.qkv_bias:
        absent.add(QKV_BIAS)
    if not shape.qk_norm:
        absent.update(QK_NORMS)
    return {name: hf for name, hf in _ALL_LAYER_PARAMS.items() if name not in absent}


# Megatron's local layer spec names the two norms after their modules; the Transformer
# Engine spec (and the checkpoint) after the linear they are fused into.
LOCAL_SPEC_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def canonical_layer_param(name: str) -> str:
    """The checkpoint name of a layer parameter, under either layer spec."""
    return LOCAL_SPEC_NAMES.get(name, name)


def megatron_layer_key(name: str) -> str:
    """The stacked checkpoint key of a layer parameter (``decoder.layers.<name>``)."""
    return f"decoder.layers.{name}"


def megatron_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Global shape of every Megatron checkpoint tensor (vocabulary unpadded)."""
    d, h, f = shape.head_dim, shape.hidden_size, shape.ffn_hidden_size
    qkv_rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * d
    per_layer = {
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": (qkv_rows, h),
        QKV_BIAS: (qkv_rows,),
        QK_NORMS[0]: (d,),
        QK_NORMS[1]: (d,),
        "self_attention.linear_proj.weight": (h, shape.num_attention_heads * d),
        "mlp.linear_fc1.layer_norm_weight": (h,),
        "mlp.linear_fc1.weight": (2 * f, h),
        "mlp.linear_fc2.weight": (h, f),
    }
    shapes = {megatron_layer_key(k): (shape.num_layers, *per_layer[k]) for k in layer_params(shape)}
    shapes[EMBEDDING] = (shape.vocab_size, h)
    shapes[FINAL_NORM] = (h,)
    if not shape.tie_word_embeddings:
        shapes[OUTPUT_LAYER] = (shape.vocab_size, h)
    return shapes


def hf_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the model and its shape."""
    d, h, f = shape.head_dim, shape.hidden_size, shape.ffn_hidden_size
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    sizes = {
        "model.layers.{i}.input_layernorm.weight": (h,),
        "model.layers.{i}.self_attn.q_proj.weight": (q, h),
        "model.layers.{i}.self_attn.k_proj.weight": (kv, h),
        "model.layers.{i}.self_attn.v_proj.weight": (kv, h),
        "model.layers.{i}.self_attn.q_proj.bias": (q,),
        "model.layers.{i}.self_attn.k_proj.bias": (kv,),
        "model.layers.{i}.self_attn.v_proj.bias": (kv,),
        "model.layers.{i}.self_attn.q_norm.weight": (d,),
        "model.layers.{i}.self_attn.k_norm.weight": (d,),
        "model.layers.{i}.self_attn.o_proj.weight": (h, q),
        "model.layers.{i}.post_attention_layernorm.weight": (h,),
        "model.layers.{i}.mlp.gate_proj.weight": (f, h),
        "model.layers.{i}.mlp.up_proj.weight": (f, h),
        "model.layers.{i}.mlp.down_proj.weight": (h, f),
    }
    per_layer = [name for names in layer_params(shape).values() for name in names]
    shapes = {name.format(i=i): sizes[name] for i in range(shape.num_layers) for name in per_layer}
    shapes["model.embed_tokens.weight"] = (shape.vocab_size, h)
    shapes["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    return shapes


def hf_names_of(megatron_key: str, layer: int | None = None) -> tuple[str, ...]:
    """HF names that make up Megatron tensor ``megatron_key`` (of ``layer`` for layer params)."""
    if megatron_key == EMBEDDING:
        return ("model.embed_tokens.weight",)
    if megatron_key == OUTPUT_LAYER:
        return ("lm_head.weight",)
    if megatron_key == FINAL_NORM:
        return ("model.norm.weight",)
    name = megatron_key.removeprefix("decoder.layers.")
    if name not in _ALL_LAYER_PARAMS or layer is None:
        raise KeyError(f"no HF mapping for Megatron tensor {megatron_key!r} (layer {layer})")
    return tuple(n.format(i=layer) for n in _ALL_LAYER_PARAMS[name])


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q/k/v (weights ``[rows, hidden]`` or biases ``[rows]``) -> Megatron's grouped QKV."""
    groups, per_group, d = shape.num_query_groups, shape.heads_per_group, shape.head_dim
    tail = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, per_group * d, *tail),
            k.reshape(groups, d, *tail),
            v.reshape(groups, d, *tail),
        ],
        dim=1,
    )  # [groups, (per_group + 2) * d, ...]
    return fused.reshape(-1, *tail)


def split_qkv(
    fused: torch.Tensor, shape: ModelShape, out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's grouped QKV -> HF q, k, v (contiguous).

    Rows are picked with ``index_select`` (whole contiguous rows per copy). ``out`` reuses
    caller-owned buffers, which avoids faulting in fresh memory on every weight sync.
    """
    groups, per_group, d = shape.num_query_groups, shape.heads_per_group, shape.head_dim
    block = (per_group + 2) * d  # rows per query group
    starts = torch.arange(groups).unsqueeze(1) * block  # [groups, 1]

    def rows(first: int, count: int) -> torch.Tensor:
        return (starts + first + torch.arange(count)).reshape(-1).to(fused.device)

    indices = (rows(0, per_group * d), rows(per_group * d, d), rows((per_group + 1) * d, d))
    if out is None:
        return tuple(fused.index_select(0, index) for index in indices)
    return tuple(torch.index_select(fused, 0, index, out=buffer) for index, buffer in zip(indices, out))


def to_megatron(megatron_key: str, hf_tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """One Megatron tensor (one layer's slice, unstacked) from its HF tensors, in
    :func:`hf_names_of` order."""
    if megatron_key.endswith("linear_qkv.weight") or megatron_key.endswith("linear_qkv.bias"):
        return interleave_qkv(*hf_tensors, shape)
    if megatron_key.endswith("linear_fc1.weight"):
        return torch.cat(hf_tensors, dim=0)
    (tensor,) = hf_tensors
    return tensor


def to_hf(
    megatron_key: str,
    tensor: torch.Tensor,
    shape: ModelShape,
    layer: int | None = None,
    buffers: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, torch.Tensor]:
    """HF tensors from one Megatron tensor (one layer's slice; vocabulary padding stripped).

    Tensors that must be rearranged (q/k/v) are written into ``buffers[hf_name]`` when a
    dict is given (created on first use and reused); the rest may be views of ``tensor``.
    """
    names = hf_names_of(megatron_key, layer)
    if megatron_key.endswith("linear_qkv.weight") or megatron_key.endswith("linear_qkv.bias"):
        out = None
        if buffers is not None:
            rows = (shape.num_attention_heads * shape.head_dim, *(2 * (shape.num_query_groups * shape.head_dim,)))
            out = tuple(buffers.setdefault(n, tensor.new_empty((r, *tensor.shape[1:]))) for n, r in zip(names, rows))
        return dict(zip(names, split_qkv(tensor, shape, out)))
    if megatron_key.endswith("linear_fc1.weight"):
        gate, up = torch.chunk(tensor, 2, dim=0)
        return dict(zip(names, (gate.contiguous(), up.contiguous())))
    if megatron_key in VOCAB_KEYS:
        tensor = tensor[: shape.vocab_size]
    return {names[0]: tensor.contiguous()}


def megatron_tensor_order(shape: ModelShape) -> list[tuple[str, int | None]]:
    """``(megatron_key, layer)`` pairs in model order: embedding, layers, final norm, output."""
    order: list[tuple[str, int | None]] = [(EMBEDDING, None)]
    for i in range(shape.num_layers):
        order.extend((megatron_layer_key(name), i) for name in layer_params(shape))
    order.append((FINAL_NORM, None))
    if not shape.tie_word_embeddings:
        order.append((OUTPUT_LAYER, None))
    return order


def shard_to_hf_pieces(
    megatron_key: str,
    shard: torch.Tensor,
    shape: ModelShape,
    layer: int | None,
    tp_rank: int,
    tp_size: int,
) -> list[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """One tensor-parallel rank's shard of a Megatron tensor as ``(hf_name, piece,
    offset)``: each piece is a view of ``shard`` (no copy) that belongs at ``offset`` (its
    start index in every dimension) of the full HF tensor, so the ranks of a stage can
    each send their own shards and no rank gathers the others'.

    Sharding is megatron's: q/k/v by query group and gate/up by rows (column parallel,
    each rank holding ``[gate_r; up_r]``), the output projection and down by columns
    (row parallel), the embedding and output layer by padded vocabulary rows (padding
    dropped). Unsharded tensors (the norms) are sent whole by tensor-parallel rank 0 only.
    """
    names = hf_names_of(megatron_key, layer)
    d, h, f = shape.head_dim, shape.hidden_size, shape.ffn_hidden_size
    zeros = (0,) * (shard.dim() - 1)
    if megatron_key.endswith("linear_qkv.weight") or megatron_key.endswith("linear_qkv.bias"):
        local_groups = shape.num_query_groups // tp_size
        q_rows = shape.heads_per_group * d
        block = q_rows + 2 * d
        if shard.shape[0] != local_groups * block:
            raise ValueError(f"{megatron_key}: shard of {shard.shape[0]} rows, expected {local_groups * block}")
        pieces = []
        for j in range(local_groups):
            group = tp_rank * local_groups + j
            rows = shard[j * block : (j + 1) * block]
            pieces += [
                (names[0], rows[:q_rows], (group * q_rows, *zeros)),
                (names[1], rows[q_rows : q_rows + d], (group * d, *zeros)),
                (names[2], rows[q_rows + d :], (group * d, *zeros)),
            ]
        return pieces
    if megatron_key.endswith("linear_fc1.weight"):
        local = f // tp_size
        if shard.shape != (2 * local, h):
            raise ValueError(f"{megatron_key}: shard of shape {tuple(shard.shape)}, expected {(2 * local, h)}")
        return [(names[0], shard[:local], (tp_rank * local, 0)), (names[1], shard[local:], (tp_rank * local, 0))]
    if megatron_key.endswith("linear_proj.weight") or megatron_key.endswith("linear_fc2.weight"):
        columns = shard.shape[1]
        return [(names[0], shard, (0, tp_rank * columns))]
    if megatron_key in VOCAB_KEYS:
        start = tp_rank * shard.shape[0]
        rows = max(0, min(shape.vocab_size - start, shard.shape[0]))
        return [(names[0], shard[:rows], (start, 0))] if rows else []
    return [(names[0], shard, (0,) * shard.dim())] if tp_rank == 0 else []
