"""One DAPO step on a GPU through the real system: the device check a lent GPU runs.

The actor runs on CUDA with NCCL in bf16 with megatron's local transformer spec (no
Transformer Engine, which cannot be carried to the lent machine), on a small Qwen2 shape;
the transformers engine runs on the same GPU in its own Ray process and is fed by CUDA
IPC handles (the colocated path); ``train`` runs two DAPO steps and the weight syncs.
Afterwards the engine's served weights must equal the actor's export exactly, every
metric must be finite, and the fp32-result logits path (``torch.mm(..., out_dtype)``)
must equal a float64 reference of the bf16 products. Skipped without a GPU.

Run on a lent device: ``pytest -q tests/gpu/test_gpu_train_step.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dapo_megatron.config import config_from_dict
from tests.e2e.conftest import run_config
from tests.e2e.conftest import tiny_model as tiny_model  # noqa: F401 - the fixture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_bf16_chunk_logits_are_the_gemms_fp32_result_on_cuda():
    from dapo_megatron.actor.vocab_parallel import _chunk_logits

    torch.manual_seed(0)
    hidden = (torch.randn(512, 1024, device="cuda") * 0.3).bfloat16()
    weight = (torch.randn(4096, 1024, device="cuda") * 0.3).bfloat16()
    reference = hidden.double() @ weight.double().t()
    logits = _chunk_logits(hidden, weight, 1.0, torch.empty(512, 4096, device="cuda"))
    assert (logits.double() - reference).abs().max() < 1e-3
    assert (torch.matmul(hidden, weight.t()).double() - reference).abs().max() > 1e-2  # bf16 result: worse


@pytest.mark.timeout(900)
def test_one_dapo_step_on_cuda_with_the_engine_fed_by_cuda_ipc(tiny_model, tmp_path):  # noqa: F811
    from dapo_megatron.run.trainer import train

    seen = {}

    def inspect(actor, engines):
        seen["actor"] = actor.export_hf_weights()
        seen["engine"] = engines.served_weights(0)
        seen["infos"] = actor.infos

    run_dir = tmp_path / "run"
    raw = run_config(tiny_model, run_dir, **{"rollout.colocate": True})
    raw["parallel"].update(device="cuda", num_devices_per_node=1, tp_size=1)
    raw["model"].update(transformer_impl="local", params_dtype="bfloat16")
    raw["rollout"].update(engine="hf")
    raw["trainer"].update(num_steps=2)
    train(config_from_dict(raw, "gpu"), inspect=inspect)

    assert seen["infos"][0]["device"].startswith("cuda")
    actor, engine = seen["actor"], seen["engine"]
    assert set(actor) == set(engine)
    for name in actor:
        assert torch.equal(actor[name].cpu().to(engine[name].dtype), engine[name].cpu()), name
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "actor/loss" in s or "reward/score_mean" in s]
    assert steps and all(math.isfinite(v) for s in steps for v in s.values() if isinstance(v, float))
