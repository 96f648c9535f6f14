"""The KL penalty in a run: the reference is the initial policy, logged as ``actor/kl_loss``, restored on resume from the
initial weights so that a resumed run is the uninterrupted one; refused without initial
weights."""

from __future__ import annotations

import shutil

import pytest

from dapo_megatron.config import ConfigError, config_from_dict
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import FOUR_STEPS, ONE_RANK, joined, run_config, step_metrics


def _kl_run(tiny_model, out, **overrides):
    raw = run_config(
        tiny_model, out, **{**FOUR_STEPS, **ONE_RANK, "trainer.num_steps": 2, "checkpoint.save_every": 1, **overrides}
    )
    raw["algorithm"].update(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3")
    return raw


@pytest.mark.timeout(900)
def test_kl_penalty_to_the_initial_policy_survives_resume(tiny_model, tmp_path, shared_ray):
    whole = tmp_path / "whole"
    train(config_from_dict(joined(_kl_run(tiny_model, whole), shared_ray)))
    metrics = step_metrics(whole)
    # The policy moves away from the initial one: the penalty is positive.
    assert sorted(metrics) == [1, 2] and all(metrics[s]["actor/kl_loss"] > 0 for s in (1, 2))
    assert "time/ref_log_prob" in _raw_keys(whole)
    split = tmp_path / "split"
    train(config_from_dict(joined(_kl_run(tiny_model, split, **{"trainer.num_steps": 1}), shared_ray)))
    train(config_from_dict(joined(_kl_run(tiny_model, split), shared_ray)), resume=True)
    # The reference after resume is the initial policy again (not the resumed weights):
    # every metric of step 2 is the uninterrupted run's.
    assert step_metrics(split) == metrics


def _raw_keys(run) -> set:
    import json

    return {k for line in (run / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}


def test_kl_penalty_without_initial_weights_is_refused(tiny_model, tmp_path):
    shape_only = tmp_path / "config_only"
    shape_only.mkdir()
    shutil.copy(tiny_model / "model/config.json", shape_only / "config.json")  # no weights: random init
    raw = _kl_run(tiny_model, tmp_path / "run")
    raw["model"]["hf_config"] = str(shape_only / "config.json")
    raw["data"]["tokenizer"] = str(tiny_model / "model")
    with pytest.raises(ConfigError, match="use_kl_loss: the KL penalty's reference policy is the run's initial"):
        train(config_from_dict(raw, "kl.yaml"))
    assert not (tmp_path / "run").exists()  # refused before anything was written
