"""Check a conversion the way a user would: same prompts, same logits as transformers.

Loads the Megatron checkpoint into megatron-core's GPTModel (one CPU rank, fp32) and the
HF checkpoint into ``transformers``' own model of its family (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``; fp32), runs a few fixed random
prompts through both, and returns the largest logit difference relative to the largest
logit. A wrong QKV interleave, a swapped gate/up, a missing bias, a missing q/k norm or a misplaced norm shows
up here as an error of order 1, while an exact conversion stays at fp32 rounding.

A conversion that also changes the dtype (``--dtype bfloat16`` from an fp32 checkpoint)
rounds every weight once, which moves the logits by about 1e-3: a fixed tolerance would
either refuse every such conversion or hide a mapping error of that size. Instead the
rounding itself is checked exactly: both models' weights are rounded to the written dtype
(``weights_dtype``) and then run in fp32. Rounding is elementwise and deterministic, so an
exact mapping gives identical weights on both sides (rounding an already rounded weight
changes nothing) and the logits again agree to fp32 rounding, with the same tolerance.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

NUM_PROMPTS = 3
PROMPT_TOKENS = 16


TOLERANCE = 1e-4
"""Largest accepted relative logit difference: fp32 rounding of the two forward passes."""


def _round_weights(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> None:
    """Round every parameter to ``dtype`` and back to fp32, in place."""
    if dtype is None or dtype == torch.float32:
        return
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(dtype).to(parameter.dtype))


def compare_logits(
    hf_dir: str | os.PathLike,
    megatron_ckpt: str | os.PathLike,
    *,
    weights_dtype: Optional[torch.dtype] = None,
    seed: int = 0,
) -> float:
    """max |logits_megatron - logits_hf| / max |logits_hf| over a few random prompts.

    ``weights_dtype``: the dtype the conversion wrote; both models' weights are rounded to
    it before the fp32 forward passes (see the module docstring).
    """
    from transformers import AutoModelForCausalLM

    from dapo_megatron.ckpt.loading import load_megatron_weights
    from dapo_megatron.config import ModelConfig, ParallelConfig, resolve_model_shape
    from dapo_megatron.models.gpt import build_model
    from dapo_megatron.runtime.distributed import megatron_runtime

    model = ModelConfig(hf_config=str(Path(hf_dir)), params_dtype="float32", transformer_impl="local")
    resolve_model_shape(model)
    tokens = torch.randint(
        0, model.vocab_size, (NUM_PROMPTS, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed)
    )
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    _round_weights(hf, weights_dtype)
    hf.eval()
    with torch.no_grad():
        reference = hf(tokens).logits
    del hf
    parallel = ParallelConfig(device="cpu")
    env = {name: os.environ.pop(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name in os.environ}
    try:
        with megatron_runtime(parallel, seed=seed):
            gpt = build_model(model, parallel, "cpu", output_logits=True)
            load_megatron_weights(gpt, megatron_ckpt)
            _round_weights(gpt, weights_dtype)
            gpt.eval()
            with torch.no_grad():
                positions = torch.arange(PROMPT_TOKENS).expand_as(tokens)
                logits = gpt(tokens, positions, None)[..., : model.vocab_size]
    finally:
        os.environ.update(env)
    return float((logits - reference).abs().max() / reference.abs().max())
