"""Actor (tp=2, pp=2) -> transformers engine: bitwise weights, same generations, same log-probs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dapo_megatron.ckpt.convert import megatron_to_hf
from dapo_megatron.rollout.hf_engine import hf_config_for
from dapo_megatron.runtime.launch import launch_local
from tests.distributed import actor_worker
from tests.distributed.conftest import copy_initial


@pytest.fixture(scope="module")
def synced(tmp_path_factory, initial_checkpoint):
    workdir = tmp_path_factory.mktemp("sync")
    copy_initial(initial_checkpoint, workdir)
    launch_local(actor_worker.sync_generate_train, 4, (str(workdir), 2, 2))
    for step in (1, 2):
        _export_by_the_converter(workdir, f"actor_{step}", f"hf_{step}")
    return workdir


def _export_by_the_converter(workdir, checkpoint: str, out: str) -> None:
    """The reference: a checkpoint's weights exported by the checkpoint converter (the
    mapping the sync uses), into ``workdir / out``."""
    config = hf_config_for(actor_worker.actor_config(1, 1).model)
    config.save_pretrained(workdir / "hf_config")
    megatron_to_hf(workdir / checkpoint, workdir / "hf_config", workdir / out, verify=False, progress=False)


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


@pytest.mark.timeout(600)
def test_each_replica_feeds_its_own_engines_and_no_rank_relays_more_than_its_stage(tmp_path, with_initial):
    """2 replicas x 2 stages, 4 engines, one per rank: every engine gets exactly the
    model, and each rank sends its own stage once, to its replica's other feeder; nothing
    crosses replicas (the first replica's leaders used to send their stage to all 3)."""
    with_initial(tmp_path)
    launch_local(actor_worker.sync_every_rank_feeds, 4, (str(tmp_path),))
    engines = [torch.load(tmp_path / f"engine_of_rank_{rank}.pt") for rank in range(4)]
    _export_by_the_converter(tmp_path, "init", "hf_init")
    expected = load_file(str(tmp_path / "hf_init" / "model.safetensors"))
    for weights in engines:
        assert set(weights) == set(expected)
        assert all(torch.equal(weights[name], expected[name]) for name in expected)
    total = sum(t.nbytes for t in expected.values())
    sent = [json.loads((tmp_path / f"sent_by_rank_{rank}.json").read_text()) for rank in range(4)]
    by_place = {(s["dp"], s["pp"]): s["sent"] for s in sent}
    for dp in (0, 1):
        assert by_place[(dp, 0)] > 0 and by_place[(dp, 1)] > 0
        assert by_place[(dp, 0)] + by_place[(dp, 1)] == total  # each stage sent once, within the replica
    assert by_place[(0, 0)] == by_place[(1, 0)] and by_place[(0, 1)] == by_place[(1, 1)]
