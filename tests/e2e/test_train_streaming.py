"""Training with streamed generation, through the whole system: as rounds when a tick
covers a round. (The exact resume with carried groups and partial multi-turn episodes in
flight is ``tests/e2e/test_train_moe.py``'s, with routing replay on top.)"""

from __future__ import annotations

import pytest

from dapo_megatron.config import config_from_dict
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import FOUR_STEPS, joined, run_config, step_metrics

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
