"""`dapo-megatron bench` on the CPU example config: every phase, its ceiling ratio, in JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dapo_megatron import cli
from dapo_megatron.bench.ceilings import published_peak
from tests.e2e.conftest import REPO, _demo_prepare


def _demo_inputs(root: Path) -> None:
    """The demo's tokenizer and task, and a random base model of its committed architecture
    (the benchmark measures speed: the prepared model's skill does not matter)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    prepare = _demo_prepare()
    tokenizer = prepare.build_tokenizer(root / "base")
    prepare.write_task(root / "data")
    torch.manual_seed(0)
    fields = json.loads((REPO / "examples/demo/model_config.json").read_text())
    config = Qwen2Config(**{**fields, "eos_token_id": tokenizer.eos_token_id})
    Qwen2ForCausalLM(config).save_pretrained(root / "base")


def test_bench_on_the_cpu_example_config_writes_every_phase_with_its_ceiling_ratio(tmp_path, capsys, shared_ray):
    """The command line's own ``main`` in this process, on the package's Ray head."""
    _demo_inputs(tmp_path)
    out = tmp_path / "bench.json"
    command = [
        "bench",
        str(REPO / "examples/demo/demo.yaml"),
        f"model.hf_weights={tmp_path / 'base'}",
        f"data.train_files=[{tmp_path / 'data/train.jsonl'}]",
        f"data.val_files=[{tmp_path / 'data/val.jsonl'}]",
        # A random model answers nothing right: every group would be dropped. The step's
        # work is the same with all groups kept.
        "algorithm.dynamic_sampling=false",
        f"ray.address={shared_ray}",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--reward-responses",
        "200",
        "--json",
        str(out),
    ]
    capsys.readouterr()
    status = cli.main(command)
    printed, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert list(phases) == ["generate", "logprob", "train", "sync", "reward", "step"]
    ceilings = result["ceilings"]
    assert ceilings["matmul_flops_per_s"] > 0 and ceilings["copy_bytes_per_s"] > 0
    assert len(ceilings["matmul_flops_per_s_per_rank"]) == 2  # both ranks measured at once
    for name in ("generate", "logprob", "train"):
        ratio = phases[name]["of_matmul_ceiling"]
        assert 0 < ratio < 1.5, (name, ratio)  # a phase doing more than matmuls cannot beat them by much
        assert phases[name]["seconds"]["n"] == 2
    # Same batch: the train phase's model FLOPs are three forward passes of the log-prob phase's.
    assert phases["train"]["model_flops"] == 3 * phases["logprob"]["model_flops"]
    assert phases["train"]["tokens"] == phases["logprob"]["tokens"]
    assert 0 < phases["sync"]["of_copy_ceiling"] and phases["sync"]["bytes"] > 0
    assert 0 < phases["reward"]["of_read_ceiling"] < 1 and phases["reward"]["responses"] == 200
    step = phases["step"]
    assert set(step["phases"]) == {
        "generate",
        "reward",
        "old_log_prob",
        "train",
        "sync",
        "wait_for_generation",
        "outside_phases",
    }
    assert 0 <= step["overhead_share"] < 1 and math.isclose(step["of_ceiling"], 1 - step["overhead_share"])
    for record in phases.values():
        assert record["seconds"]["median"] > 0
    assert "device:" in printed and "step breakdown" in printed


def test_published_peaks_match_the_longest_name():
    assert published_peak("NVIDIA H200").bf16_tflops == 989.4
    assert published_peak("NVIDIA H20").bf16_tflops == 148.0
    assert published_peak("NVIDIA H100 PCIe").bf16_tflops == 756.0
    assert published_peak("NVIDIA H100 80GB HBM3").memory_tb_per_s == 3.35
    assert published_peak("Intel(R) Xeon(R)") is None
