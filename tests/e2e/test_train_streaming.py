"""Training with streamed generation, through the whole system: as rounds when a tick
covers a round, and an exact resume with carried groups and partial multi-turn episodes
in flight."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_megatron.ckpt.dcp_io import latest_checkpoint
from dapo_megatron.config import config_from_dict
from dapo_megatron.run.resume import STREAM_STATE
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import FOUR_STEPS, ONE_RANK, joined, run_config, step_metrics

pytestmark = pytest.mark.timeout(900)


def _streamed(root, out, **overrides):
    raw = run_config(root, out, **{**FOUR_STEPS, **overrides})
    raw["rollout"].update(max_response_length=12, streaming=True, stream_chunk_tokens=3, max_prompts_in_flight=6)
    raw["algorithm"]["overlong_buffer_len"] = 4
    return raw


def test_streaming_with_one_tick_per_round_trains_as_rounds_do(tiny_model, tmp_path, uninterrupted, shared_ray):
    """Every metric of the rounds (the uninterrupted run's first two steps, which
    test_resume shows a two-step run of the same config logs too), to the bit, from the
    streamed path when each tick covers a whole round (chunks of max_response_length
    tokens, a round in flight)."""
    streamed = run_config(tiny_model, tmp_path / "streamed", **{**FOUR_STEPS, "trainer.num_steps": 2})
    streamed["rollout"].update(streaming=True, stream_chunk_tokens=6, max_prompts_in_flight=4)
    train(config_from_dict(joined(streamed, shared_ray), "e2e"))
    expected, got = step_metrics(uninterrupted[0]), step_metrics(tmp_path / "streamed")
    assert sorted(got) == [1, 2] and sorted(expected) == [1, 2, 3, 4]
    for step in (1, 2):
        assert {k: got[step][k] for k in expected[step]} == expected[step], step
        assert got[step]["stream/aborted_tokens"] == 0.0  # a round ends when its last group does


def test_a_streamed_run_with_carried_groups_and_partial_episodes_resumes_exactly(tiny_model, tmp_path, shared_ray):
    """Streamed multi-turn episodes (``tests/e2e/environments.py``) with carried groups and
    partial responses: 2 steps + resume + 2 steps equal 4 steps to the bit. The save holds
    episodes cut in flight, some after answered tool calls (their turns in the checkpoint,
    replayed on resume)."""
    switches = {"carry_over": True, "partial_rollout": True, "env": "tests.e2e.environments:PlusCalls", "max_turns": 3}
    whole, split = tmp_path / "whole", tmp_path / "split"
    raw = _streamed(tiny_model, whole, **ONE_RANK)
    raw["rollout"].update(switches)
    train(config_from_dict(joined(raw, shared_ray), "e2e"))
    raw = _streamed(tiny_model, split, **{"trainer.num_steps": 2, **ONE_RANK})
    raw["rollout"].update(switches)
    train(config_from_dict(joined(raw, shared_ray), "e2e"))
    state = torch.load(latest_checkpoint(split / "checkpoints") / STREAM_STATE, weights_only=True)
    assert state["partial"] or state["carried_sizes"]  # something was in flight at the save
    saved_episodes = [episode for item in state["partial"] for episode in item["episodes"]]
    assert any(len(episode["turn_ends"]) > 0 for episode in saved_episodes)  # cut after an answered call
    raw = _streamed(tiny_model, split, **ONE_RANK)
    raw["rollout"].update(switches)
    train(config_from_dict(joined(raw, shared_ray), "e2e"), resume=True)
    expected, got = step_metrics(whole), step_metrics(split)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in expected:
        assert got[step] == expected[step], step
    steps = list(expected.values())
    assert any(s["stream/partial_in_responses"] > 0 for s in steps)
    assert any(s["stream/carried_in_groups"] > 0 or s["stream/partial_in_responses"] > 0 for s in steps[2:])
    assert all("rollout_correction/weight_mean" in s for s in steps)  # auto: token-level TIS
    assert all(s["staleness/max"] <= 1 for s in steps) and any(s["staleness/max"] == 1 for s in steps)
    for s in steps:
        assert not [k for k, v in s.items() if isinstance(v, float) and not math.isfinite(v)]
        assert s["episode/observation_tokens"] > 0 and 1 <= s["episode/turns_mean"] <= 3
