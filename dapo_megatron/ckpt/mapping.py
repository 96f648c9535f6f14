"""The one place that knows how HF names and layouts map to Megatron's, for every model
family (``dapo_megatron.families``): computed from the family's features, so a
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
  tensor ``[num_layers, ...]``; in a mixture-of-experts model with dense layers among the
  others each layer has keys of its own, ``decoder.layers.<i>.<name>`` (:func:`stored_key`).
- **Vocabulary**: Megatron pads it to a multiple of ``divisor * tp``. Converted checkpoints
  store the HF rows only (Megatron's embedding and output layer load with a shape
  mismatch allowed, zero-filling padding); converting back strips any padding.
- **Tied embeddings**: no ``output_layer.weight`` and no ``lm_head.weight``.
- **Experts** (Qwen3-MoE): the router ``mlp.router.weight`` is HF ``mlp.gate.weight``;
  megatron stores each layer's experts as one tensor with the expert as the second axis
  (``decoder.layers.mlp.experts.experts.linear_fc1.weight``: ``[num_layers, num_experts,
  2 * moe_ffn, hidden]``, each expert ``[gate; up]``), HF as one tensor per expert
  (``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``). A rank holds the experts
  of its expert-parallel rank, ``ep_rank * local + j`` for its ``j``-th local one, under
  ``mlp.experts.local_experts.{j}.linear_fc1.weight`` (sequential experts) or
  ``mlp.experts.linear_fc1.weight{j}`` (grouped GEMM).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from dapo_megatron.families import DEFAULT_MODEL_TYPE, family_named

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
VOCAB_KEYS = (EMBEDDING, OUTPUT_LAYER)

QKV_BIAS = "self_attention.linear_qkv.bias"
QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
ROUTER = "mlp.router.weight"
EXPERT_FC1 = "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.experts.linear_fc2.weight"
EXPERT_PARAMS = (EXPERT_FC1, EXPERT_FC2)
"""Layer parameters with one slice per expert (the expert is their first axis)."""

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
    ROUTER: ("model.layers.{i}.mlp.gate.weight",),
    # Of each expert {e}, in expert order.
    EXPERT_FC1: (
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    ),
    EXPERT_FC2: ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",),
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
    num_experts: int = 0
    """Routed experts per layer; 0 for a dense model (a SwiGLU MLP of ``ffn_hidden_size``)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of one expert's SwiGLU MLP."""
    moe_router_topk: int = 0
    """Experts each token is routed to."""
    dense_layers: tuple[int, ...] = ()
    """Layers of a model with experts that keep a dense MLP (HF ``mlp_only_layers`` and
    the layers ``decoder_sparse_step`` skips). With any, megatron stores every layer under
    its own checkpoint keys (``decoder.layers.<i>.<name>``, no layer axis)."""

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
        expert_fields = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk")
        features = ("qkv_bias", "qk_norm", "dense_layers", *expert_fields)
        fields = {name: get(name) for name in cls.__dataclass_fields__ if name not in features}
        experts = {}
        if family.moe:
            skipped, step = set(get("mlp_only_layers") or []), get("decoder_sparse_step") or 1
            dense = tuple(i for i in range(get("num_layers")) if i in skipped or (i + 1) % step)
            experts = {**{name: get(name) for name in expert_fields}, "dense_layers": dense}
        return cls(**fields, qkv_bias=family.qkv_bias, qk_norm=family.qk_norm, **experts)


def has_experts(shape: ModelShape, layer: int) -> bool:
    """Whether ``layer`` of ``shape`` is a mixture-of-experts layer."""
    return bool(shape.num_experts) and layer not in shape.dense_layers


def layer_params(shape: ModelShape, layer: Optional[int] = None) -> dict[str, tuple[str, ...]]:
    """Megatron layer parameter -> HF names of layer ``{i}``, for ``shape``'s family: of
    ``layer`` (dense or with experts), or with ``None`` of any of its layers."""
    absent = set()
    if not shape.qkv_bias:
        absent.add(QKV_BIAS)
    if not shape.qk_norm:
        absent.update(QK_NORMS)
    kinds = {has_experts(shape, i) for i in (range(shape.num_layers) if layer is None else [layer])}
    if True not in kinds:
        absent.update((ROUTER, *EXPERT_PARAMS))
    if False not in kinds:
        absent.update(DENSE_MLP)
    return {name: hf for name, hf in _ALL_LAYER_PARAMS.items() if name not in absent}


def stacked(shape: ModelShape) -> bool:
    """Whether megatron stores each layer parameter as one tensor with the layer as its
    first axis (every layer alike), or each layer's under its own key (``dense_layers``)."""
    return not shape.dense_layers


def stored_key(shape: ModelShape, megatron_key: str, layer: Optional[int]) -> str:
    """The checkpoint key that holds layer ``layer``'s slice of ``megatron_key``: the key
    itself when layers are stacked, ``decoder.layers.<layer>.<name>`` when not."""
    if layer is None or stacked(shape):
        return megatron_key
    return f"decoder.layers.{layer}.{megatron_key.removeprefix('decoder.layers.')}"


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
        ROUTER: (shape.num_experts, h),
        EXPERT_FC1: (shape.num_experts, 2 * (shape.moe_ffn_hidden_size or 0), h),
        EXPERT_FC2: (shape.num_experts, h, shape.moe_ffn_hidden_size or 0),
    }
    if stacked(shape):
        shapes = {megatron_layer_key(k): (shape.num_layers, *per_layer[k]) for k in layer_params(shape)}
    else:
        shapes = {
            stored_key(shape, megatron_layer_key(k), i): per_layer[k]
            for i in range(shape.num_layers)
            for k in layer_params(shape, i)
        }
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
        "model.layers.{i}.mlp.gate.weight": (shape.num_experts, h),
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": (shape.moe_ffn_hidden_size, h),
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight": (shape.moe_ffn_hidden_size, h),
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight": (h, shape.moe_ffn_hidden_size),
    }
    shapes = {}
    for i in range(shape.num_layers):
        for key in layer_params(shape, i):
            for name in _ALL_LAYER_PARAMS[key]:
                for e in range(shape.num_experts) if key in EXPERT_PARAMS else (None,):
                    shapes[name.format(i=i, e=e)] = sizes[name]
    shapes["model.embed_tokens.weight"] = (shape.vocab_size, h)
    shapes["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    return shapes


def hf_names_of(
    megatron_key: str, layer: int | None = None, shape: Optional[ModelShape] = None, experts=None
) -> tuple[str, ...]:
    """HF names that make up Megatron tensor ``megatron_key`` (of ``layer`` for layer
    params). An expert tensor is made of the names of every expert in ``experts`` (all of
    ``shape``'s by default), expert by expert."""
    if megatron_key == EMBEDDING:
        return ("model.embed_tokens.weight",)
    if megatron_key == OUTPUT_LAYER:
        return ("lm_head.weight",)
    if megatron_key == FINAL_NORM:
        return ("model.norm.weight",)
    name = megatron_key.removeprefix("decoder.layers.")
    if name not in _ALL_LAYER_PARAMS or layer is None:
        raise KeyError(f"no HF mapping for Megatron tensor {megatron_key!r} (layer {layer})")
    if name in EXPERT_PARAMS:
        if experts is None:
            if shape is None:
                raise ValueError(
                    f"{megatron_key}: the HF names of an expert tensor need the model shape or the experts"
                )
            experts = range(shape.num_experts)
        return tuple(n.format(i=layer, e=e) for e in experts for n in _ALL_LAYER_PARAMS[name])
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
    if megatron_key == megatron_layer_key(EXPERT_FC1):  # [gate_e; up_e] of each expert: [experts, 2f, h]
        return torch.stack([torch.cat(hf_tensors[j : j + 2], dim=0) for j in range(0, len(hf_tensors), 2)])
    if megatron_key == megatron_layer_key(EXPERT_FC2):  # [experts, h, f]
        return torch.stack(hf_tensors)
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
    if megatron_key in (megatron_layer_key(EXPERT_FC1), megatron_layer_key(EXPERT_FC2)):
        return expert_to_hf(megatron_key, tensor, layer, range(tensor.shape[0]))
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


def expert_to_hf(megatron_key: str, tensor: torch.Tensor, layer: int, experts) -> dict[str, torch.Tensor]:
    """HF tensors of the experts ``experts`` (global indices) from their slices of an expert
    tensor (``tensor[j]`` is expert ``experts[j]``); views, no copy."""
    experts = list(experts)
    if tensor.shape[0] != len(experts):
        raise ValueError(f"{megatron_key}: {tensor.shape[0]} expert slices for experts {experts}")
    names = hf_names_of(megatron_key, layer, experts=experts)
    if megatron_key == megatron_layer_key(EXPERT_FC1):
        halves = [half for j in range(len(experts)) for half in torch.chunk(tensor[j], 2, dim=0)]
        return dict(zip(names, halves))
    return dict(zip(names, tensor.unbind(0)))


def megatron_tensor_order(shape: ModelShape) -> list[tuple[str, int | None]]:
    """``(megatron_key, layer)`` pairs in model order: embedding, layers, final norm, output."""
    order: list[tuple[str, int | None]] = [(EMBEDDING, None)]
    for i in range(shape.num_layers):
        order.extend((megatron_layer_key(name), i) for name in layer_params(shape, i))
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


_HF_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fused_expert_param(name: str) -> Optional[str]:
    """The transformers 5 fused parameter (``mlp.experts.gate_up_proj`` or ``down_proj``)
    that holds checkpoint tensor ``name`` (``...mlp.experts.{e}.gate_proj.weight``), or
    None when ``name`` is no expert tensor."""
    match = _HF_EXPERT.match(name)
    if match is None:
        return None
    return f"{match['experts']}.{'down_proj' if match['proj'] == 'down_proj' else 'gate_up_proj'}"


def fused_expert_view(params: dict[str, torch.Tensor], name: str) -> Optional[torch.Tensor]:
    """Where checkpoint tensor ``name`` (``...mlp.experts.{e}.gate_proj.weight``) lives in a
    transformers model whose experts are fused 3D parameters (transformers 5:
    ``mlp.experts.gate_up_proj`` ``[experts, 2 * f, hidden]``, each expert ``[gate; up]``,
    and ``mlp.experts.down_proj`` ``[experts, hidden, f]``): a view of ``params``' tensor,
    or None when ``name`` is no expert tensor or the model keeps its experts unfused."""
    fused = params.get(fused_expert_param(name) or "")
    if fused is None:
        return None
    match = _HF_EXPERT.match(name)
    e = int(match["e"])
    if match["proj"] == "down_proj":
        return fused[e]
    half = fused.shape[1] // 2
    return fused[e, :half] if match["proj"] == "gate_proj" else fused[e, half:]
