"""Weights & Biases beside TensorBoard, tested offline (no network): every metric under
its name and step in the W&B run, a table of responses, a resumed run continuing the same
W&B run, and the settings refused without ``logging.wandb``."""

from __future__ import annotations

import io

import pytest

from dapo_megatron.config import ConfigError, LoggingConfig, load_config
from dapo_megatron.run.metrics_log import MetricsLogger
from dapo_megatron.run.wandb_sink import RUN_ID_FILE, WandbSink
from tests.e2e.conftest import REPO
from tests.unit.wandb_offline import history, run_ids

OFFLINE = LoggingConfig(tensorboard=False, wandb=True, wandb_mode="offline", wandb_tags=["test"])


def test_every_metric_reaches_the_offline_run_and_a_resumed_run_continues_it(tmp_path):
    metrics = {"reward/score_mean": 0.25, "actor/grad_norm": 1.5, "time/step": 0.5}
    sink = WandbSink(tmp_path, OFFLINE, {"trainer": {"lr": 1e-6}}, resume=False)
    with MetricsLogger(tmp_path, OFFLINE, 4, io.StringIO(), sink=sink) as log:
        log.log(1, metrics)
        log.log(2, {name: value * 2 for name, value in metrics.items()})
        log.log(2, {"val/accuracy": 0.75}, console=True)
    sink.table(2, [{"step": 2, "prompt": "1+1=", "response": "Answer: 2", "reward": 1.0, "kept": True}])
    sink.close()
    first_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    assert "offline run" in sink.where() and first_id in sink.where()

    resumed = WandbSink(tmp_path, OFFLINE, {}, resume=True)
    with MetricsLogger(tmp_path, OFFLINE, 4, io.StringIO(), sink=resumed, resume_after=2) as log:
        log.log(3, metrics)
    resumed.close()
    assert resumed.run_id == first_id and run_ids(tmp_path) == {first_id}
    rows = history(tmp_path)
    assert {name: rows[1][name] for name in metrics} == metrics
    assert rows[2]["reward/score_mean"] == 0.5 and rows[2]["val/accuracy"] == 0.75
    assert rows[2]["rollouts/samples/nrows"] == 1 and rows[2]["rollouts/samples/ncols"] == 8
    assert rows[3]["actor/grad_norm"] == 1.5


def test_wandb_settings_act_only_with_wandb_and_need_its_package(monkeypatch):
    demo = REPO / "examples" / "demo" / "demo.yaml"
    with pytest.raises(ConfigError, match="logging.wandb_project acts only with logging.wandb=true"):
        load_config(demo, ["logging.wandb_project=mine"])
    assert load_config(demo, ["logging.wandb=true", "logging.wandb_project=mine"]).logging.wandb_project == "mine"
    import builtins

    from dapo_megatron.run.wandb_sink import import_wandb

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match=r"logging.wandb=true needs the wandb package .*pip install -e '.\[wandb\]'"):
        import_wandb()
