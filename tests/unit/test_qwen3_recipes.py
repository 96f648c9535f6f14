"""The Qwen3 recipes: their plans fit on nodes of 8 x 80 GB, their parameter counts are
the published models', and the Qwen2.5-32B recipe's SLURM scripts run them (RECIPE)."""

from __future__ import annotations

import json

import pytest

from dapo_megatron.cli import main
from dapo_megatron.config import load_config
from dapo_megatron.plan import active_parameters, count_parameters, estimate_memory
from tests.unit.test_recipe import ROOT, _dry_run

MOE = ROOT / "examples" / "qwen3_30b_a3b" / "dapo.yaml"
DENSE = ROOT / "examples" / "qwen3_32b" / "dapo.yaml"


@pytest.fixture(autouse=True)
def _elsewhere(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)


def test_the_moe_recipe_fits_on_four_nodes_with_the_published_size(capsys):
    cfg = load_config(MOE)
    assert (cfg.model.family, cfg.model.num_experts, cfg.model.moe_router_topk) == ("qwen3_moe", 128, 8)
    # Qwen3-30B-A3B: "30.5B in total, 3.3B activated".
    assert count_parameters(cfg) == 30_532_122_624 and active_parameters(cfg) == 3_353_032_704
    assert (cfg.parallel.world_size, cfg.parallel.tp_size, cfg.parallel.ep_size) == (32, 4, 8)
    memory = estimate_memory(cfg)
    assert memory.rollout_phase <= 80 * 2**30 and memory.train_phase <= 80 * 2**30
    assert main(["plan", str(MOE)]) == 0
    out = capsys.readouterr().out
    assert "128 experts of width 768 per layer, top 8: 3,353,032,704 active per token" in out
    assert "experts: ep 8 (16 per rank), expert-dp 4" in out and out.rstrip().endswith("fits")


def test_the_dense_qwen3_recipe_fits_with_the_published_size(capsys):
    cfg = load_config(DENSE)
    assert cfg.model.family == "qwen3" and cfg.model.head_dim == 128
    assert count_parameters(cfg) == 32_762_123_264  # Qwen3-32B: "32.8B"
    assert main(["plan", str(DENSE)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("fits")


def test_parameter_counts_equal_transformers_for_the_moe_family(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    demo = ROOT / "examples" / "demo"
    hf = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**json.loads((demo / "model_config_moe.json").read_text()))
    )
    cfg = load_config(demo / "demo_moe.yaml")
    assert count_parameters(cfg) == sum(p.numel() for p in hf.parameters()) == 1_331_776
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    assert active_parameters(cfg) == count_parameters(cfg) - experts // 2  # top 2 of 4
    # A dense layer among them (mlp_only_layers): its SwiGLU instead of experts and router.
    mixed = {**json.loads((demo / "model_config_moe.json").read_text()), "mlp_only_layers": [1]}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**mixed))
    (tmp_path / "config.json").write_text(json.dumps(mixed))
    cfg = load_config(demo / "demo_moe.yaml", [f"model.hf_config={tmp_path / 'config.json'}"])
    assert cfg.model.mlp_only_layers == [1]
    assert count_parameters(cfg) == sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    assert active_parameters(cfg) == count_parameters(cfg) - experts // 2


def test_the_shared_scripts_run_a_qwen3_recipe(tmp_path):
    (tmp_path / "qwen3_30b_a3b_mcore").mkdir()  # convert.sbatch's output for this recipe: train.sbatch loads it
    result = _dry_run(
        "train.sbatch",
        RECIPE="examples/qwen3_30b_a3b/dapo.yaml",
        MODEL_DIR="/models/Qwen3-30B-A3B",
        OUTPUT_DIR=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    train = [line for line in result.stdout.splitlines() if "dapo-megatron train " in line]
    assert len(train) == 1 and "dapo-megatron train examples/qwen3_30b_a3b/dapo.yaml " in train[0]
    assert f"checkpoint.load_dir={tmp_path / 'qwen3_30b_a3b_mcore'}" in train[0]
    plan = [line for line in result.stdout.splitlines() if "dapo-megatron plan" in line]
    assert f"plan {MOE} " in plan[0]
    convert = _dry_run("convert.sbatch", RECIPE="examples/qwen3_32b/dapo.yaml", MODEL_DIR="/models/Qwen3-32B")
    assert convert.returncode == 0 and "--out /runs/dapo/qwen3_32b_mcore" in convert.stdout
    missing = _dry_run("train.sbatch", RECIPE="examples/qwen3_14b/dapo.yaml")
    assert missing.returncode == 2
    assert "RECIPE=examples/qwen3_14b/dapo.yaml: no such file under" in missing.stderr
