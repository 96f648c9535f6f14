"""The SGLang engine for real (GPU with sglang installed): generation, weight sync, memory.

Skipped on machines without a GPU or without sglang; the CPU suite checks the wrapper
against SGLang's source instead (tests/unit/test_sglang_contract.py).
"""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.weight_sync.bucket import WeightBucket
from tests.unit.test_convert import hf_tensors, make_hf

pytestmark = pytest.mark.gpu


@pytest.fixture
def engine(tmp_path):
    pytest.importorskip("sglang")
    from dapo_megatron.rollout.sglang_engine import SGLangRolloutEngine, mark_engine_process

    mark_engine_process()  # this test process plays the engine worker

    hf = make_hf(tmp_path / "hf", vocab=256, layers=2)
    engine = SGLangRolloutEngine(str(hf), tp_size=1, mem_fraction_static=0.2, dtype="float32")
    yield engine, hf
    engine.shutdown()


def _greedy_reference(hf_dir, prompts, max_new_tokens):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).cuda().eval()
    outs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]).cuda(), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
            )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def test_generate_sync_release_resume(engine, tmp_path):
    engine, hf = engine
    prompts = [[5, 17, 99, 3], [42, 8]]
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    out = engine.generate(prompts, greedy)
    assert [g.token_ids for g in out] == _greedy_reference(hf, prompts, 6)
    assert all(len(g.log_probs) == len(g.token_ids) and g.finish_reason == "length" for g in out)

    other = make_hf(tmp_path / "other", vocab=256, layers=2, seed=5)
    tensors = list(hf_tensors(other).items())
    stats = engine.update_weights([WeightBucket(tensors[i : i + 7]) for i in range(0, len(tensors), 7)])
    assert stats.num_tensors == len(tensors)
    assert [g.token_ids for g in engine.generate(prompts, greedy)] == _greedy_reference(other, prompts, 6)

    engine.release_memory()
    assert not engine.health()["ok"]
    engine.resume_memory()
    # SGLang kept no copy of the weights: a complete update must come first.
    assert engine.health()["needs_full_update"] and not engine.health()["ok"]
    with pytest.raises(RuntimeError, match="sync the actor's weights"):
        engine.generate(prompts, greedy)
    engine.update_weights([WeightBucket(tensors[i : i + 7]) for i in range(0, len(tensors), 7)])
    assert engine.health()["ok"] and engine.health()["engine"] == "sglang"
    assert [g.token_ids for g in engine.generate(prompts, greedy)] == _greedy_reference(other, prompts, 6)
