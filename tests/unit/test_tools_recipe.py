"""The tool-using Qwen2.5-32B recipe: the published recipe with the ``python`` environment;
``plan`` fits it and says what its episodes cost, and the shared SLURM scripts run it."""

from __future__ import annotations

import pytest

from dapo_megatron.cli import main
from dapo_megatron.config import load_config
from dapo_megatron.sampling.environments import make_environment
from tests.unit.test_recipe import ROOT, _dry_run

TOOLS = ROOT / "examples" / "qwen2_5_32b_tools" / "dapo.yaml"
PUBLISHED = ROOT / "examples" / "qwen2_5_32b" / "dapo.yaml"


@pytest.fixture(autouse=True)
def _elsewhere(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)


def test_the_tools_recipe_is_the_published_one_with_a_sandboxed_interpreter(capsys):
    tools, published = load_config(TOOLS), load_config(PUBLISHED)
    assert (tools.rollout.env, tools.rollout.max_turns) == ("python", 8)
    environment = make_environment(tools.rollout.env, tools.rollout.env_options)
    assert environment.concurrent_steps == 64 and environment.limits.memory_bytes == 2 << 30
    assert "<code>" in tools.data.system_prompt and "Answer: $Answer" in tools.data.system_prompt
    # Everything else is the published recipe's.
    for section in ("model", "parallel", "algorithm"):
        assert getattr(tools, section) == getattr(published, section), section
    assert (
        tools.trainer.num_steps == published.trainer.num_steps and tools.data.train_files == published.data.train_files
    )
    assert main(["plan", str(TOOLS)]) == 0
    out = capsys.readouterr().out
    assert (
        "episodes: rollout.env=python, at most 8 model turns in 20480 tokens after the prompt; each block a sandboxed "
        "process of at most 2 GiB of address space and 10 s; 64 at once on the node that runs the trainer: up to "
        "128 GiB and 64 CPU cores there"
    ) in out and out.rstrip().endswith("fits")


def test_the_shared_scripts_run_the_tools_recipe(tmp_path):
    (tmp_path / "qwen2_5_32b_tools_mcore").mkdir()  # convert.sbatch's output for this recipe
    result = _dry_run(
        "train.sbatch",
        RECIPE="examples/qwen2_5_32b_tools/dapo.yaml",
        MODEL_DIR="/models/Qwen2.5-32B",
        OUTPUT_DIR=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    train = [line for line in result.stdout.splitlines() if "dapo-megatron train " in line]
    assert len(train) == 1 and "dapo-megatron train examples/qwen2_5_32b_tools/dapo.yaml " in train[0]
