"""Rollout records: a step's rows (trained and dropped, with their advantage and both
log-probs), the bounded draw of groups, whole files only, and no step twice after a resume."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
import torch

from dapo_megatron.config import LoggingConfig
from dapo_megatron.data import Prompt
from dapo_megatron.run.rollout_records import RolloutRecorder, StepRollouts, record_path, step_rows, write_rows
from dapo_megatron.sampling.samples import Sample


def _sample(group: int, index: int, correct: bool) -> Sample:
    prompt = Prompt(group, (1, 2), "4", "demo", f"{group}+2=")
    return Sample(
        group_id=(0, group),
        prompt=prompt,
        response_ids=[5, 6, 7],
        engine_log_probs=[-0.5, -0.25, -1.0],
        finish_reason="stop",
        text=f"Answer: {index}",
        correct=correct,
        score=1.0 if correct else -1.0,
        overlong_penalty=-0.5 if index == 1 else 0.0,
        policy_version=3,
    )


def _rollouts() -> StepRollouts:
    kept = [_sample(0, 0, True), _sample(0, 1, False)]
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])  # the second: its last token masked
    engine = torch.tensor([[0.0, -0.5, -0.25, -1.0], [0, -0.5, -0.25, -1.0]])
    actor = torch.tensor([[0.0, -0.5, -0.5, -1.0], [0, -0.4, -0.25, -9.0]])
    dropped = [([_sample(1, 0, True), _sample(1, 1, True)], "all_right")]
    return StepRollouts(kept, torch.tensor([1.0, -1.0]), mask, engine, actor, dropped)


def test_a_steps_rows_say_what_was_trained_how_and_what_was_dropped_and_why():
    rows = step_rows(7, _rollouts(), groups=0, seed=1)
    assert [(r["step"], r["kept"], r["dropped"]) for r in rows] == [
        (7, True, None),
        (7, True, None),
        (7, False, "all_right"),
        (7, False, "all_right"),
    ]
    first, second = rows[0], rows[1]
    assert (first["advantage"], first["trained_tokens"], second["trained_tokens"]) == (1.0, 3, 2)
    assert first["engine_log_prob_mean"] == pytest.approx((-0.5 - 0.25 - 1.0) / 3)
    assert first["actor_log_prob_mean"] == pytest.approx((-0.5 - 0.5 - 1.0) / 3) and first["log_prob_gap_max"] == 0.25
    assert second["log_prob_gap_max"] == pytest.approx(0.1)  # not 8: its masked last token is out
    assert second["reward"] == -1.5 and second["overlong_penalty"] == -0.5 and second["policy_versions"] == [3, 3]
    assert first["prompt"] == "0+2=" and first["response"] == "Answer: 0" and first["response_tokens"] == 3
    assert "advantage" not in rows[2]
    # At most ``groups`` groups, drawn with the step's seed: the same draw every time.
    one = step_rows(7, _rollouts(), groups=1, seed=1)
    assert len(one) == 2 and one == step_rows(7, _rollouts(), groups=1, seed=1)
    assert len({r["group"][1] for r in one}) == 1


def test_files_are_whole_and_a_resumed_run_drops_the_steps_after_its_checkpoint(tmp_path, caplog):
    path = record_path(tmp_path, 3)
    size = write_rows(path, [{"step": 3, "a": "é"}])
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        assert [json.loads(line) for line in handle] == [{"step": 3, "a": "é"}]
    assert size == path.stat().st_size and [p.name for p in path.parent.iterdir()] == ["step_000003.jsonl.gz"]
    for step in (4, 5):
        write_rows(record_path(tmp_path, step), [])
    write_rows(record_path(tmp_path, 5, "val_step"), [])
    with RolloutRecorder(tmp_path, LoggingConfig(rollout_records_every=2), seed=0, resume_after=4) as recorder:
        assert sorted(p.name for p in path.parent.iterdir()) == ["step_000003.jsonl.gz", "step_000004.jsonl.gz"]
        assert recorder.wants(6) and not recorder.wants(5)
        recorder.record_step(6, _rollouts())
        recorder.record_step(7, _rollouts())  # not a recorded step
    assert record_path(tmp_path, 6).exists() and not record_path(tmp_path, 7).exists()
    # A write that fails is logged, not raised: the run goes on.
    (tmp_path / "blocked").write_text("a file where the records' folder would be")
    with caplog.at_level(logging.WARNING), RolloutRecorder(tmp_path / "blocked", LoggingConfig(), seed=0) as failing:
        failing.record_step(1, _rollouts())
    assert "writing rollout records failed" in caplog.text


def test_an_episodes_row_holds_its_turns_in_order():
    from dapo_megatron.run.rollout_records import episode_turns

    sample = _sample(0, 0, True)
    sample.response_ids, sample.model_mask = [1, 2, 3, 4, 5, 6], [1, 1, 0, 0, 1, 1]
    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731
    assert episode_turns(sample, decode) == [
        {"by": "model", "text": "ab"},
        {"by": "environment", "text": "cd"},
        {"by": "model", "text": "ef"},
    ]
