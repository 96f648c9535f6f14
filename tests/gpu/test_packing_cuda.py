"""Packed sequences against padded rows on one GPU, with megatron's local spec and, where
it is installed, Transformer Engine.

Why: on the CPU the packed path is checked against padded rows and a float64 reference
(tests/distributed/test_reference_gradient.py), with megatron's local attention run per
segment (``models/gpt.py``: ``segment_attention_class``). On a GPU the same code runs on
CUDA kernels; Transformer Engine's THD attention is another kernel altogether, which a
machine without TE (the lent device, the CI) cannot run: that step skips, saying why, and
runs on a user's GPU machine with TE.

- local spec, fp32 on CUDA: old log-probs within 1e-5 of the padded rows', gradients
  within 1e-5 (relative), and the largest attention-score tensor is the longest
  sequence's square, not the packed row's;
- Transformer Engine, bf16, THD: old log-probs within 5e-2 of the padded rows' (both bf16),
  gradients within 5e-2.

Run on a lent device: ``pytest -q tests/gpu/test_packing_cuda.py`` (well under a minute).
"""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.runtime.launch import launch_local
from tests.distributed import reference_worker
from tests.distributed.actor_worker import tiny_hf_model
from tests.distributed.test_reference_gradient import SEEDS, _merged, _randomize_biases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _steps(tmp_path, transformer_impl: str, params_dtype: str) -> tuple[dict, dict, list]:
    model = tiny_hf_model("qwen2", False, seed=SEEDS["qwen2"], attn_implementation="eager")
    _randomize_biases(model)
    model.save_pretrained(tmp_path / "hf_tied0")
    args = (str(tmp_path), 1, 1, 1, False, "cuda", transformer_impl, params_dtype)
    launch_local(reference_worker.packed_and_unpacked_steps, 1, args)
    runs = {pack: torch.load(tmp_path / f"pack{pack}_stage0.pt") for pack in (0, 1)}
    batches = {pack: torch.load(tmp_path / f"pack{pack}_batch.pt", weights_only=False) for pack in (0, 1)}
    rows = [mb for mini in runs[1]["row_lengths"] for mb in mini]
    assert any(len(mb) >= 2 for mb in rows), rows  # some rows really are packed
    return runs, batches, rows


def _assert_close(runs, batches, tolerance: float) -> None:
    mask = batches[0].response_mask().bool()
    gap = float((batches[1].old_log_probs - batches[0].old_log_probs)[mask].abs().max())
    assert gap <= tolerance, gap
    padded, packed = _merged([runs[0]], "gradients", 0), _merged([runs[1]], "gradients", 0)
    for name, expected in padded.items():
        error = float((packed[name].double() - expected.double()).norm() / expected.double().norm())
        assert error <= tolerance, (name, error)


def test_packed_equals_padded_on_cuda_with_the_local_spec(tmp_path):
    runs, batches, rows = _steps(tmp_path, "local", "float32")
    _assert_close(runs, batches, 1e-5)
    longest = max(max(mb) for mb in rows)
    assert runs[1]["attention_scores_numel"] == 4 * longest**2  # 4 heads; a row reaches 24 tokens


def test_packed_equals_padded_with_transformer_engine_thd(tmp_path):
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed here (pip install '.[gpu]')")
    runs, batches, _ = _steps(tmp_path, "transformer_engine", "bfloat16")
    _assert_close(runs, batches, 5e-2)
