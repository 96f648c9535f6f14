"""A converted HF checkpoint, loaded by megatron at (tp, pp) = (2, 2), gives transformers' logits."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.ckpt.convert import hf_to_megatron
from dapo_megatron.runtime.launch import launch_local
from tests.distributed import convert_worker
from tests.unit.test_convert import make_hf


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied", [False, True])
def test_converted_checkpoint_at_tp2_pp2_matches_transformers(tmp_path, tied):
    from transformers import Qwen2ForCausalLM

    # vocab 250 is padded to 256 at tp=2 (128 rows per rank); 4 layers split 2 + 2.
    hf = make_hf(tmp_path / "hf", tied=tied, vocab=250, layers=4)
    hf_to_megatron(hf, tmp_path / "mg", verify=False, progress=False)
    tokens = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1))
    out = tmp_path / "logits.pt"
    launch_local(convert_worker.logits_at_layout, 4, (str(hf), str(tmp_path / "mg"), str(out), 2, 2, tokens))
    megatron_logits = torch.load(out)
    with torch.no_grad():
        reference = Qwen2ForCausalLM.from_pretrained(str(hf), dtype=torch.float32)(tokens).logits
    assert megatron_logits.shape == reference.shape == (2, 12, 250)
    assert (megatron_logits - reference).abs().max().item() <= 1e-5
