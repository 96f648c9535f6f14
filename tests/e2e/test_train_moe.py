"""``train`` end to end on a tiny Qwen3-MoE at ep 2: Ray, two Megatron ranks whose
experts are split between them (tokens cross by megatron's all-to-all on gloo), the
transformers engine fed experts by name, the routing metrics, a checkpoint; and rollout
routing replay through streamed, partial multi-turn episodes, resumed exactly."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_megatron.ckpt.dcp_io import latest_checkpoint
from dapo_megatron.config import config_from_dict
from dapo_megatron.run.resume import STREAM_STATE
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import FOUR_STEPS, joined, run_config, step_metrics


def _replayed(root, out, steps: int) -> dict:
    overrides = {**FOUR_STEPS, "trainer.num_steps": steps, "checkpoint.save_every": 1, "rollout.colocate": True}
    raw = run_config(root, out, **overrides)
    raw["parallel"].update(tp_size=1, ep_size=2)
    # The tiny model's config.json has output_router_logits false (HF's default), which the
    # default coefficient follows (0, no load-balancing loss): set one, to train with it.
    raw["model"].update(routing_replay="rollout", moe_aux_loss_coeff=0.001)
    raw["rollout"].update(
        max_response_length=12,
        streaming=True,
        stream_chunk_tokens=3,
        max_prompts_in_flight=6,
        carry_over=True,
        partial_rollout=True,
        env="tests.e2e.environments:PlusCalls",
        max_turns=3,
    )
    raw["algorithm"]["overlong_buffer_len"] = 4
    return raw


@pytest.mark.timeout(900)
def test_moe_at_ep2_with_routing_replay_through_partial_episodes_resumes_exactly(tiny_moe, tmp_path, shared_ray):
    """``model.routing_replay: rollout`` at ep 2 (the experts split over two ranks) with
    streamed multi-turn episodes, carried groups and partial responses: in every pass the
    actor's routers pick, at every position the engine routed, the engine's experts
    (``routing_changed_engine`` 0: the routers' own output compared with the engine's
    record), and so the updates' too; 2 steps equal 1 + resume + 1 to the bit, the save
    holding partial responses with the routing of their prefix, and episodes cut after
    answered tool calls (their turns in the checkpoint, replayed on resume): the streamed
    multi-turn resume test of the suite. The engine serves the actor's weights, experts by
    name, bitwise."""
    seen = {}

    def inspect(actor, engines):
        seen["actor"] = actor.export_hf_weights()
        seen["engine"] = engines.served_weights(0)

    whole, split = tmp_path / "whole", tmp_path / "split"
    config = config_from_dict(joined(_replayed(tiny_moe, whole, 2), shared_ray), "e2e")
    assert (config.model.family, config.model.moe_aux_loss_coeff) == ("qwen3_moe", 0.001)
    train(config, inspect=inspect)
    assert any(".mlp.experts.1.up_proj.weight" in name for name in seen["actor"])
    assert sorted(seen["engine"]) == sorted(seen["actor"])
    for name, tensor in seen["actor"].items():
        assert torch.equal(seen["engine"][name], tensor), name
    train(config_from_dict(joined(_replayed(tiny_moe, split, 1), shared_ray), "e2e"))
    state = torch.load(latest_checkpoint(split / "checkpoints") / STREAM_STATE, weights_only=True)
    rows = [
        (item["prompt_ids"], row, episode)
        for item in state["partial"]
        for row, episode in zip(item["rows"], item["episodes"])
        if len(row["token_ids"])
    ]
    assert rows, "nothing was in flight at the save"
    for prompt_ids, row, episode in rows:
        # Every position the engine has fed: all but the last token, and but an observation
        # appended after the last turn (the next turn's request feeds it).
        mask = episode["model_mask"].tolist() if episode["length"] == len(row["token_ids"]) else [1]
        observed = len(mask) - len("".join(map(str, mask)).rstrip("0"))
        assert len(row["routed_experts"]) == len(prompt_ids) + len(row["token_ids"]) - 1 - observed
    train(config_from_dict(joined(_replayed(tiny_moe, split, 2), shared_ray), "e2e"), resume=True)
    expected, got = step_metrics(whole), step_metrics(split)
    assert sorted(got) == sorted(expected) == [1, 2]
    for step in expected:
        assert got[step] == expected[step], step
    for step in expected.values():
        assert step["moe/routing_changed_engine"] == 0.0 and step["moe/routing_changed"] == 0.0
        assert step["moe/replayed_share"] == 1.0 and step["moe/unreplayed_loss_tokens"] == 0.0
        assert math.isfinite(step["moe/load_balancing_loss"]) and step["moe/tokens_per_expert_max_over_mean"] >= 1
        assert step["episode/turns_mean"] >= 1
    # The engine (transformers' fused experts) and the actor (megatron's sequential ones)
    # compute the same policy in fp32: close, not equal (step 1: nothing sampled by older
    # weights yet, which partial responses are later).
    assert 0 <= expected[1]["rollout_mismatch/kl_k3_mean"] < 1e-3 and expected[1]["staleness/max"] == 0
    assert expected[2]["stream/partial_in_responses"] > 0
    assert (split / "checkpoints" / "latest").exists()
    # What the save held: episodes cut in flight after an answered tool call (their turns
    # in the checkpoint, replayed on resume).
    assert any(len(item_episode["turn_ends"]) > 0 for _, _, item_episode in rows)
    steps = list(expected.values())
    assert all("rollout_correction/weight_mean" in s for s in steps)  # auto: token-level TIS
    assert all(s["staleness/max"] <= 1 for s in steps) and steps[1]["staleness/max"] == 1
    for s in steps:
        assert not [k for k, v in s.items() if isinstance(v, float) and not math.isfinite(v)]
        assert s["episode/observation_tokens"] > 0 and 1 <= s["episode/turns_mean"] <= 3
