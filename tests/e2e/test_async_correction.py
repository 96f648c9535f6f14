"""The rollout correction of a one-step-off-policy run, against float64.

In an async run, step 2 trains on a batch the engines sampled with the initial weights
(version 0) while the actor is at version 1. Its token TIS weights are
``min(exp(old - rollout), C)``, with ``old`` the actor's log-probs at version 1 and
``rollout`` the engine's at version 0. Both are recomputed here in float64 with
transformers' own Qwen2, from the initial HF weights and from the weights the engines
were served after step 1; the weights the actor trained with must match, and must differ
from 1 (a correction that does nothing would pass a test on on-policy data).
"""

from __future__ import annotations

import json

import pytest
import torch

import dapo_megatron.run.step as step_module
from dapo_megatron.config import config_from_dict
from dapo_megatron.orchestration.actor_group import ActorGroup
from dapo_megatron.run.step import StepRunner
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import ONE_RANK, joined, run_config

CAP = 1.05  # low enough that some weights are capped


def _float64_log_probs(model, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Label-grid log-probs of ``tokens`` (column t: token t given tokens[:t]; column 0: 0)."""
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[:, :-1] / temperature  # [rows, seq - 1, vocab]
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(chosen, (1, 0))


@pytest.mark.timeout(600)
def test_async_tis_weights_equal_a_float64_reference(tiny_model, tmp_path, monkeypatch, shared_ray):
    from transformers import Qwen2ForCausalLM

    corrections, batches, served = [], [], []
    original_weights, original_train, original_sync = step_module.correction_weights, ActorGroup.train, StepRunner.sync

    def capture_weights(old, rollout, mask, *args):
        weights, metrics = original_weights(old, rollout, mask, *args)
        corrections.append({"old": old, "rollout": rollout, "mask": mask.bool(), "weights": weights})
        return weights, metrics

    def capture_train(self, batch, num_mini_batches, temperature):
        batches.append(batch)
        return original_train(self, batch, num_mini_batches, temperature)

    def capture_sync(self):
        stats = original_sync(self)
        served.append(self.system.engines.served_weights())
        return stats

    monkeypatch.setattr(step_module, "correction_weights", capture_weights)
    monkeypatch.setattr(ActorGroup, "train", capture_train)
    monkeypatch.setattr(StepRunner, "sync", capture_sync)
    raw = run_config(
        tiny_model,
        tmp_path / "run",
        **{
            "trainer.num_steps": 2,
            "trainer.val_every": 0,
            "trainer.val_before_train": False,
            "trainer.lr": 1e-2,
            **ONE_RANK,
        },
    )
    raw["trainer"]["async_generation"] = True
    raw["checkpoint"]["save_every"] = 0
    raw["algorithm"].update(rollout_correction="tis", rollout_correction_cap=CAP)
    temperature = raw["rollout"]["temperature"]
    train(config_from_dict(joined(raw, shared_ray), "e2e"))
    assert len(corrections) == len(batches) == 2 and len(served) == 2
    # Step 1 generated step 2's batch while it trained; the last step, with no checkpoint
    # to hold a batch ahead, generated none.
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [("time/wait_for_generation" in s) for s in steps if "reward/score_mean" in s] == [True, False]

    initial = Qwen2ForCausalLM.from_pretrained(tiny_model / "model", dtype=torch.float64)
    after_step_1 = Qwen2ForCausalLM.from_pretrained(tiny_model / "model", dtype=torch.float64)
    after_step_1.load_state_dict({k: v.double() for k, v in served[0].items()}, strict=True)
    batch, got = batches[1], corrections[1]
    mask = got["mask"]
    rollout64 = _float64_log_probs(initial, batch.tokens, temperature)
    old64 = _float64_log_probs(after_step_1, batch.tokens, temperature)
    assert (got["rollout"].double() - rollout64)[mask].abs().max() < 1e-5  # sampled by version 0
    assert (got["old"].double() - old64)[mask].abs().max() < 1e-5  # the actor at version 1
    weights64 = torch.exp(old64 - rollout64).clamp(max=CAP)
    assert (got["weights"].double() - weights64)[mask].abs().max() < 1e-5
    assert torch.equal(batch.token_weights, got["weights"].float())  # what the actor trained with
    # Off-policy for real: weights away from 1, some of them capped.
    assert (weights64[mask] - 1).abs().max() > 1e-3 and (weights64[mask] == CAP).any()
    # Step 1 was on-policy (both sides version 0): its weights are 1 up to float32 noise.
    assert (corrections[0]["weights"][corrections[0]["mask"]] - 1).abs().max() < 1e-5
