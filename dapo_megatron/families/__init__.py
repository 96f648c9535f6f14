"""The registry of model families: one module per family in this package, found here.

A family is the HF ``config.json`` ``model_type`` it reads and the architecture features
that set it apart (:class:`ModelFamily`: q/k/v bias, q/k norm, experts). Everything else (the megatron layer spec and
``TransformerConfig``, the HF <-> Megatron tensor mapping, the parameter count and memory
of ``plan``, the model FLOPs of ``bench``) is computed from those features and the
model's shape, so no code outside the family's module names a family. Adding a family
of an existing kind (a dense decoder with a new combination of the features below) is
adding one module here that defines ``FAMILY``; nothing else changes.

Pure data, no torch: the config layer reads it to validate ``model.hf_config``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class ModelFamily:
    """What one model family is, in features the rest of the system understands."""

    model_type: str
    """The HF ``config.json`` ``model_type`` (``qwen2``, ``qwen3``, ...)."""
    architecture: str
    """The transformers class (and ``config.json`` ``architectures`` entry) of the family."""
    qkv_bias: bool
    """A bias on the q, k and v projections (and on no other linear layer)."""
    qk_norm: bool
    """RMSNorm over each head's ``head_dim`` on queries and keys, before RoPE
    (HF ``self_attn.q_norm`` / ``k_norm``; megatron's ``qk_layernorm``)."""
    moe: bool = False
    """Mixture-of-experts MLPs: a top-k softmax router (HF ``mlp.gate``) over
    ``num_experts`` SwiGLU experts (HF ``mlp.experts.{e}``), no shared expert."""


@lru_cache(maxsize=1)
def families() -> dict[str, ModelFamily]:
    """Every family of this package, by ``model_type``."""
    found: dict[str, ModelFamily] = {}
    for info in pkgutil.iter_modules(__path__):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, ModelFamily):
            found[family.model_type] = family
    return dict(sorted(found.items()))


DEFAULT_MODEL_TYPE = "qwen2"
"""The family of a model whose shape is given by hand, with no ``model.family``."""


def family_named(model_type: str) -> ModelFamily:
    """The family of an HF ``model_type``; a ``ValueError`` naming the supported ones."""
    known = families()
    if model_type not in known:
        raise ValueError(f"unsupported model family {model_type!r}; supported: {', '.join(known)}")
    return known[model_type]
