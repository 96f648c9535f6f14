"""``train`` end to end on a tiny Qwen3-MoE at ep 2: Ray, two Megatron ranks whose
experts are split between them (tokens cross by megatron's all-to-all on gloo), the
transformers engine fed experts by name, the routing metrics, a checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dapo_megatron.config import config_from_dict
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import joined, run_config


@pytest.mark.timeout(600)
def test_train_moe_at_ep2_end_to_end(tiny_moe, tmp_path, shared_ray):
    seen = {}

    def inspect(actor, engines):
        seen["actor"] = actor.export_hf_weights()
        seen["engine"] = engines.served_weights(0)

    run_dir = tmp_path / "run"
    raw = run_config(tiny_moe, run_dir, **{"rollout.colocate": True})
    raw["parallel"].update(tp_size=1, ep_size=2)
    raw["trainer"].update(val_before_train=False, val_every=0)  # (validation is not what this checks)
    # The tiny model's config.json has output_router_logits false (HF's default), which the
    # default coefficient follows (0, no load-balancing loss): set one, to train with it.
    raw["model"]["moe_aux_loss_coeff"] = 0.001
    config = config_from_dict(joined(raw, shared_ray), "e2e")
    assert (config.model.family, config.model.moe_aux_loss_coeff) == ("qwen3_moe", 0.001)
    train(config, inspect=inspect)

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/score_mean" in line]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        for name in (
            "moe/load_balancing_loss",
            "moe/tokens_per_expert_max_over_mean",
            "moe/tokens_per_expert_max_over_mean_worst_layer",
            "moe/routing_changed",
        ):
            assert math.isfinite(step[name]), (name, step)
        assert 0 <= step["moe/routing_changed"] <= 1 and step["moe/tokens_per_expert_max_over_mean"] >= 1
        # The engine (transformers' fused experts) and the actor (megatron's sequential
        # ones) compute the same policy in fp32: close, not equal.
        assert 0 <= step["rollout_mismatch/kl_k3_mean"] < 1e-3
    # After the last sync the engine serves the actor's weights, experts included, bitwise.
    assert any(".mlp.experts.1.up_proj.weight" in name for name in seen["actor"])
    assert sorted(seen["engine"]) == sorted(seen["actor"])
    for name, tensor in seen["actor"].items():
        assert torch.equal(seen["engine"][name], tensor), name
    assert (run_dir / "checkpoints" / "latest").exists()
