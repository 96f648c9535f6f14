"""The trainer's count of steps whose updates went NaN or infinite."""

from __future__ import annotations

import math

import pytest

from dapo_megatron.run.trainer import BadStepCounter, TrainingDiverged, bad_metrics

GOOD = {"actor/loss": 0.1, "actor/grad_norm": 0.5, "actor/nonfinite_updates": 0.0}
SKIPPED = {"actor/loss": math.nan, "actor/grad_norm": math.nan, "actor/nonfinite_updates": 2.0}


def test_what_counts_as_a_bad_step():
    assert bad_metrics(GOOD) == []
    assert bad_metrics(SKIPPED) == ["actor/nonfinite_updates", "actor/loss"]
    assert bad_metrics({**GOOD, "actor/grad_norm": math.inf}) == ["actor/grad_norm"]
    # An all-empty step (every row filtered) reports a NaN grad norm: not a bad step.
    assert bad_metrics({**GOOD, "actor/loss": 0.0, "actor/grad_norm": math.nan}) == []


def test_the_run_stops_after_the_configured_count_in_a_row():
    counter = BadStepCounter(limit=2)
    counter.record(1, SKIPPED, None)
    counter.record(2, GOOD, None)  # a good step resets the count
    counter.record(3, SKIPPED, "/run/checkpoints/step_00000002")
    with pytest.raises(TrainingDiverged, match="stopped at step 4: 2 steps in a row") as info:
        counter.record(4, SKIPPED, "/run/checkpoints/step_00000002")
    message = str(info.value)
    assert "trainer.max_bad_steps_in_a_row=2" in message and "actor/nonfinite_updates=2.0" in message
    assert "actor/loss=nan" in message and "step_00000002 (--resume continues from it)" in message
    never = BadStepCounter(limit=0)
    for step in range(1, 20):
        never.record(step, SKIPPED, None)
    assert never.in_a_row == 19
