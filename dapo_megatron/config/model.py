"""The model section of a run config: the policy's shape, read from its HF ``config.json``.

Kept apart from :mod:`dapo_megatron.config` because it is the part that grows with every
model family: which ``config.json`` keys a family has (the experts of a mixture-of-experts
family, for instance), and how the shape given by hand and the one read from the file are
reconciled. Pure data, no torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from dapo_megatron.config.io import COMMAND_LINE, ConfigError
from dapo_megatron.families import DEFAULT_MODEL_TYPE, families, family_named


@dataclass
class ModelConfig:
    """The policy model: a decoder of a supported family (``dapo_megatron.families``:
    Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE), described by its HF config or by hand."""

    hf_config: Optional[str] = None
    """Path to an HF ``config.json`` (or the folder holding it) of a supported family. Shape
    fields left unset below are read from it; a shape field set here that disagrees with it
    is an error."""
    hf_weights: Optional[str] = None
    """Folder of the HF safetensors the run starts from (converted on load, unless
    ``checkpoint.load_dir`` is set) and of the default tokenizer; defaults to
    ``model.hf_config``'s folder. Lets a config carry its model shape without the weights
    being there yet (the demo's base model is written by its prepare step)."""
    family: Optional[str] = None
    """The model family, as HF ``config.json`` names it in ``model_type`` (``qwen2``,
    ``qwen3``, ``qwen3_moe``); read from ``model.hf_config``; ``qwen2`` for a shape given by hand."""
    num_layers: Optional[int] = None
    """Number of transformer layers (HF ``num_hidden_layers``)."""
    hidden_size: Optional[int] = None
    """Width of the residual stream (HF ``hidden_size``)."""
    ffn_hidden_size: Optional[int] = None
    """Width of the SwiGLU MLP (HF ``intermediate_size``)."""
    num_attention_heads: Optional[int] = None
    """Number of query heads (HF ``num_attention_heads``)."""
    num_query_groups: Optional[int] = None
    """Number of key/value heads for grouped-query attention (HF ``num_key_value_heads``)."""
    head_dim: Optional[int] = None
    """Width of one attention head (HF ``head_dim``); ``hidden_size / num_attention_heads``
    when the HF config has none (Qwen2)."""
    vocab_size: Optional[int] = None
    """Vocabulary size of the checkpoint, before Megatron's padding (HF ``vocab_size``)."""
    max_position_embeddings: Optional[int] = None
    """Longest sequence the RoPE tables are built for (HF ``max_position_embeddings``)."""
    rms_norm_eps: Optional[float] = None
    """Epsilon of every RMSNorm (HF ``rms_norm_eps``)."""
    rope_theta: Optional[float] = None
    """RoPE base frequency (HF ``rope_theta``, or ``rope_parameters.rope_theta``)."""
    tie_word_embeddings: Optional[bool] = None
    """Whether the output layer shares the input embedding matrix."""
    num_experts: Optional[int] = None
    """Routed experts of each mixture-of-experts layer (HF ``num_experts``); unset for a
    dense family."""
    moe_router_topk: Optional[int] = None
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of one expert's SwiGLU MLP (HF ``moe_intermediate_size``)."""
    moe_norm_topk_prob: Optional[bool] = None
    """Whether the top-k routing probabilities are renormalised to sum to 1 (HF
    ``norm_topk_prob``); otherwise they are the softmax over all experts."""
    decoder_sparse_step: Optional[int] = None
    """Every this many layers is a mixture-of-experts layer (HF ``decoder_sparse_step``)."""
    mlp_only_layers: Optional[list[int]] = None
    """Layers that keep a dense MLP of width ``ffn_hidden_size`` (HF ``mlp_only_layers``)."""
    moe_aux_loss_coeff: Optional[float] = None
    """Coefficient of the router's load-balancing loss, megatron's ``moe_aux_loss_coeff``:
    *per MoE layer*, each layer's loss (1 for balanced routing) times it, summed over the
    layers, per micro-batch and averaged over the micro-batches of an update. 0 turns it
    off. The default means what the HF config means (:func:`hf_aux_loss_per_layer`): HF
    adds ``router_aux_loss_coef`` times *one* loss pooled over the MoE layers (top-k for
    balanced routing), and only when ``output_router_logits`` is true, so the default is
    0 when it is false (Qwen3-30B-A3B's config, transformers' default) and otherwise
    ``router_aux_loss_coef x moe_router_topk / MoE layers`` (0.001 x 8 / 48 = 1.67e-4
    there; 0.001 per layer would be 6x HF's weight). It changes the gradient, never the
    log-probs: routing has no capacity limit, so no token is dropped and every log-prob
    is exact."""
    moe_z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (the squared log-sum-exp of the router logits,
    megatron's ``moe_z_loss_coeff``); 0 turns it off. This and the other expert keys are
    refused on a dense family (they would do nothing)."""
    routing_replay: Literal["off", "measure", "rollout", "old"] = "off"
    """Mixture-of-experts routing between the engine and the actor (refused on a dense
    family unless ``off``). ``off``: each routes on its own. ``measure``: the engine
    returns each token's experts and the actor reports how many of its tokens it routes
    elsewhere (``moe/routing_changed_engine``), without replaying them. ``rollout``
    (rollout routing replay, R3): the actor's routers take the engine's experts in the
    old-log-prob pass and every update, so a token's log-prob is computed through the
    experts that sampled it; the routers still learn through their probabilities. ``old``:
    the actor replays in every update the experts it chose itself in the old-log-prob pass
    (the engine returns nothing; refused with ``algorithm.use_rollout_log_probs``, which
    skips that pass). ``measure`` and ``rollout`` cost host memory: ``moe_layers x
    moe_router_topk`` bytes per token (``plan`` counts it)."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times ``parallel.tp_size``; padded
    entries never produce a token or a log-prob."""
    params_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype: ``auto`` is bfloat16 on GPU (fp32 main weights in the optimizer)
    and float32 on CPU."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation: Transformer Engine kernels when available on a GPU (``auto``),
    or megatron's local spec."""
    fp8: bool = False
    """Use Transformer Engine fp8 GEMMs (GPU with TE only)."""
    recompute_activations: bool = False
    """Recompute each layer's activations in backward to save memory."""

    @property
    def hf_weights_folder(self) -> Optional[Path]:
        """The HF folder the run's initial weights and default tokenizer come from:
        ``hf_weights``, else the folder ``hf_config`` names."""
        if self.hf_weights is not None:
            return Path(self.hf_weights)
        return hf_model_folder(self.hf_config)


# ModelConfig field -> HF config.json key.
_HF_KEYS = {
    "family": "model_type",
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings",
}

SHAPE_FIELDS = tuple(_HF_KEYS)

# Mixture-of-experts fields -> HF config.json keys (the first one present is read);
# read, and required, only for a family with experts.
_HF_MOE_KEYS = {
    "num_experts": ("num_experts", "num_local_experts"),
    "moe_router_topk": ("num_experts_per_tok",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_norm_topk_prob": ("norm_topk_prob",),
    "decoder_sparse_step": ("decoder_sparse_step",),
    "mlp_only_layers": ("mlp_only_layers",),
}

MOE_FIELDS = tuple(_HF_MOE_KEYS)
"""The mixture-of-experts shape fields of :class:`ModelConfig`."""


def _hf_key(name: str) -> str:
    return _HF_KEYS[name] if name in _HF_KEYS else _HF_MOE_KEYS[name][0]


def moe_layers(model: ModelConfig) -> list[bool]:
    """For each layer, whether it is a mixture-of-experts layer (HF's rule: not in
    ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0``); all False for a
    dense family."""
    if not family_named(model.family).moe:
        return [False] * model.num_layers
    dense = set(model.mlp_only_layers or [])
    step = model.decoder_sparse_step or 1
    return [i not in dense and (i + 1) % step == 0 for i in range(model.num_layers)]


def engine_routing(model: ModelConfig) -> bool:
    """Whether the engine returns the experts it routed each token to
    (``model.routing_replay`` ``measure`` or ``rollout``)."""
    return model.routing_replay in ("measure", "rollout")


def hf_aux_loss_per_layer(router_aux_loss_coef: float, output_router_logits: bool, topk: int, moe_layers: int) -> float:
    """Megatron's per-layer load-balancing coefficient that weighs the loss as an HF
    Qwen3-MoE config does.

    HF (``load_balancing_loss_func``) pools the router statistics of the ``L`` MoE layers:
    with ``F_e`` the top-k assignments to expert ``e`` over all layers and tokens divided
    by ``L*T`` and ``Q_e`` its mean router probability, it adds
    ``router_aux_loss_coef * E * sum_e F_e Q_e`` (= ``coef * k`` when balanced), and only
    when ``output_router_logits`` is true (else no loss at all). Megatron
    (``switch_load_balancing_loss_func``) adds, per layer ``l``,
    ``c * E * sum_e f_le P_le`` with ``f_le`` the share of the layer's assignments
    (``F`` over ``k``, per layer) and ``P_le`` its mean probability (1 per layer when
    balanced), summed over the layers. With ``c = coef * k / L`` the two are equal, in
    value and gradient, whenever every layer routes alike, and otherwise differ only in
    that HF multiplies pooled loads and megatron each layer's own."""
    if not output_router_logits or router_aux_loss_coef == 0 or moe_layers == 0:
        return 0.0
    return router_aux_loss_coef * topk / moe_layers


def read_hf_model_shape(hf_config: str | os.PathLike) -> dict[str, Any]:
    """Read the model shape from the HF ``config.json`` (file or folder) of a supported family.

    Returns a dict keyed by :class:`ModelConfig` field names, plus ``router_aux_loss_coef``
    and ``output_router_logits`` for a family with experts (what the default of
    ``model.moe_aux_loss_coeff`` is derived from, not a shape). Handles both spellings of
    the RoPE base: top-level ``rope_theta`` (transformers 4.x, released Qwen2.5) and
    ``rope_parameters.rope_theta`` (transformers 5.x).
    """
    path = Path(hf_config)
    if path.is_dir():
        path = path / "config.json"
    try:
        hf = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"model.hf_config={str(hf_config)!r}: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model.hf_config={str(hf_config)!r}: {path} is not valid JSON: {exc}") from None
    known = families()
    model_type = hf.get("model_type")
    if model_type not in known:
        supported = ", ".join(f"{f.model_type} ({f.architecture})" for f in known.values())
        raise ConfigError(
            f"model.hf_config={str(hf_config)!r}: unsupported model family "
            f"{model_type or hf.get('architectures')!r} (config.json's model_type); supported: {supported}"
        )
    shape: dict[str, Any] = {}
    for name, key in _HF_KEYS.items():
        value = hf.get(key)
        if name == "head_dim" and value is None and hf.get("num_attention_heads"):
            value = hf.get("hidden_size", 0) // hf["num_attention_heads"]
        if name == "rope_theta" and value is None:
            value = (hf.get("rope_parameters") or {}).get("rope_theta")
        if name == "num_query_groups" and value is None:
            value = hf.get("num_attention_heads")
        if name == "tie_word_embeddings" and value is None:
            value = False
        if value is None:
            raise ConfigError(f"model.hf_config={str(hf_config)!r}: {path} has no {key!r}")
        shape[name] = value
    if known[model_type].moe:
        for name, keys in _HF_MOE_KEYS.items():
            value = next((hf[key] for key in keys if key in hf), None)
            if value is None:
                raise ConfigError(f"model.hf_config={str(hf_config)!r}: {path} has no {keys[0]!r}")
            shape[name] = value
        shape["router_aux_loss_coef"] = float(hf.get("router_aux_loss_coef", 0.0))
        # transformers' default: off (no load-balancing loss in HF's training).
        shape["output_router_logits"] = bool(hf.get("output_router_logits", False))
    shape["rms_norm_eps"] = float(shape["rms_norm_eps"])
    shape["rope_theta"] = float(shape["rope_theta"])
    return shape


def resolve_model_shape(model: ModelConfig, where: Any = None) -> None:
    """Fill unset shape fields of ``model`` from its HF config; refuse disagreements."""
    where = where or (lambda *keys: "config")
    if model.hf_config is not None:
        try:
            shape = read_hf_model_shape(model.hf_config)
        except ConfigError as exc:
            source = where("model.hf_config")
            hint = (
                ""
                if source in ("config", COMMAND_LINE)
                else " (relative paths in a config file are relative to its folder)"
            )
            raise ConfigError(f"{source}: {exc}{hint}") from None
        aux_loss_coef = shape.pop("router_aux_loss_coef", None)
        output_router_logits = shape.pop("output_router_logits", False)
        for name, value in shape.items():
            current = getattr(model, name)
            if current is None:
                setattr(model, name, value)
            elif current != value:
                raise ConfigError(
                    f"{where('model.' + name)}: model.{name}={current!r} disagrees with "
                    f"{_hf_key(name)}={value!r} in model.hf_config={model.hf_config!r}; "
                    f"remove model.{name} or point model.hf_config at the right model"
                )
        if model.moe_aux_loss_coeff is None and aux_loss_coef is not None:
            model.moe_aux_loss_coeff = hf_aux_loss_per_layer(
                aux_loss_coef, output_router_logits, model.moe_router_topk, sum(moe_layers(model))
            )
    if model.family is None:
        model.family = DEFAULT_MODEL_TYPE
    if model.head_dim is None and model.hidden_size and model.num_attention_heads:
        model.head_dim = model.hidden_size // model.num_attention_heads
    if model.moe_aux_loss_coeff is None:
        model.moe_aux_loss_coeff = 0.0
    required = [name for name in SHAPE_FIELDS if name != "head_dim"]
    if model.family in families() and family_named(model.family).moe:
        required += MOE_FIELDS
    missing = [name for name in required if getattr(model, name) is None]
    if missing:
        raise ConfigError(
            f"{where('model.hf_config')}: model shape incomplete: {', '.join('model.' + m for m in missing)} "
            f"unset; set model.hf_config to an HF config.json or give them explicitly"
        )


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Vocabulary size after Megatron's padding to a multiple of ``divisor * tp_size``."""
    multiple = make_vocab_size_divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def hf_model_folder(hf_config: Optional[str | os.PathLike]) -> Optional[Path]:
    """The folder ``model.hf_config`` names (it may name the folder or its config.json)."""
    if hf_config is None:
        return None
    path = Path(hf_config)
    return path if path.is_dir() else path.parent
