"""Actor (tp=2, pp=2) -> transformers engine: bitwise weights, same generations, same log-probs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dapo_megatron.ckpt.convert import megatron_to_hf
from dapo_megatron.rollout.hf_engine import qwen2_config_for
from dapo_megatron.runtime.launch import launch_local
from tests.distributed import actor_worker, layout_worker


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sync")
    launch_local(layout_worker.save_initial, 1, (str(workdir),))
    launch_local(actor_worker.sync_generate_train, 4, (str(workdir), 2, 2))
    # The reference: the actor's weights exported by the checkpoint converter (same mapping).
    model = actor_worker.actor_config(1, 1).model
    from dapo_megatron.ckpt.qwen2_mapping import Qwen2Shape

    config = qwen2_config_for(
        Qwen2Shape.from_model_config(model),
        rms_norm_eps=model.rms_norm_eps,
        rope_theta=model.rope_theta,
        max_position_embeddings=model.max_position_embeddings,
    )
    config.save_pretrained(workdir / "hf_config")
    for step in (1, 2):
        megatron_to_hf(
            workdir / f"actor_{step}", workdir / "hf_config", workdir / f"hf_{step}", verify=False, progress=False
        )
    return workdir


@pytest.mark.timeout(600)
def test_engine_weights_equal_the_actor_export_bitwise(synced):
    stats = json.loads((synced / "sync_1.json").read_text())
    assert stats["num_buckets"] > 3  # it really streamed in buckets
    for step in (1, 2):
        engine = torch.load(synced / f"engine_{step}.pt")
        exported = load_file(synced / f"hf_{step}" / "model.safetensors")
        assert sorted(engine) == sorted(exported)
        for name, tensor in exported.items():
            assert torch.equal(engine[name], tensor), f"step {step}: {name} differs"
    assert stats["num_tensors"] == len(exported)
    assert stats["num_bytes"] == sum(t.nbytes for t in exported.values())


def test_weights_change_after_a_training_step_and_sync(synced):
    before, after = torch.load(synced / "engine_1.pt"), torch.load(synced / "engine_2.pt")
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) == len(before), f"unchanged after training: {sorted(set(before) - set(changed))}"


def test_greedy_generation_equals_transformers_generate(synced):
    from transformers import Qwen2ForCausalLM

    engine_tokens = torch.load(synced / "greedy.pt")
    model = Qwen2ForCausalLM.from_pretrained(str(synced / "hf_1"), dtype=torch.float32).eval()
    for prompt, tokens in zip(actor_worker.SYNC_PROMPTS, engine_tokens):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0
            )
        assert out[0, len(prompt) :].tolist() == tokens


def test_engine_sampling_log_probs_agree_with_the_actor(synced):
    consistency = json.loads((synced / "consistency.json").read_text())
    assert consistency["num_tokens"] == 6 * 10  # 3 prompts x 2 samples x 10 tokens, no stop token
    assert consistency["logprob_diff_max"] < 1e-4, consistency
