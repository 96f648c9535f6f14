"""The demo's base model follows the rule it was taught and sometimes samples the carry;
the tool demo's tokenizer and task.

DAPO can only make an answer the model's own when the model writes it now and then: the
demo's base model must be right exactly on the problems without a carry (greedy), and
sample the true sum of a carry problem often enough that a group of 8 has a correct one.
This runs the real preparation (its supervised warm-up, about 35 s on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.e2e.conftest import REPO, _demo_prepare

NO_CARRY_SHARE = sum(a + b < 10 for a in range(10) for b in range(10)) / 100  # 55 of the 100 problems


@pytest.mark.timeout(900)
def test_the_base_model_follows_its_rule_and_sometimes_writes_the_carry(tmp_path, capsys):
    prepare = _demo_prepare()
    assert prepare.main([str(tmp_path)]) == 0
    report = json.loads((tmp_path / "base" / "demo_base_report.json").read_text())
    assert NO_CARRY_SHARE == 0.55
    # Greedy: (a+b) mod 10 everywhere (bits of a CPU's kernels may flip a problem or two).
    assert report["follows_rule"] >= 0.97, report
    assert abs(report["greedy_accuracy"] - NO_CARRY_SHARE) <= 0.03, report
    # Sampled at temperature 1: the carried sum, on average in 5-30% of a carry problem's samples.
    assert 0.05 <= report["carry_sampled_accuracy"] <= 0.30, report
    printed = capsys.readouterr().out
    assert f"follows (a+b) mod 10 on {report['follows_rule']:.0%}" in printed
    # A second preparation with the same recipe keeps the files.
    assert prepare.main([str(tmp_path)]) == 0
    assert "already in" in capsys.readouterr().out


def _tools_prepare():
    spec = importlib.util.spec_from_file_location("demo_prepare_tools", REPO / "examples/demo/prepare_tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_demos_tokenizer_keeps_each_tag_whole_and_its_task_is_graded_on_the_episode(tmp_path):
    from dapo_megatron.algo.rewards.dapo_math import dapo_math_reward
    from dapo_megatron.config import DataConfig
    from dapo_megatron.data.prompts import load_tokenizer
    from dapo_megatron.sampling.environments.calculator import CalculatorEnvironment

    prepare = _tools_prepare()
    prepare.build_tokenizer(tmp_path / "tokenizer", prepare.VOCAB, prepare.PATTERN)
    prepare.write_task(tmp_path / "data")
    tokenizer = load_tokenizer(DataConfig(tokenizer=str(tmp_path / "tokenizer")), None)  # as a run loads it
    call = "<calc>983*969</calc>"
    observation = CalculatorEnvironment().start(None).step([], call).text
    episode = f"{call}{observation}Answer: {983 * 969}"
    ids = tokenizer.encode(episode, add_special_tokens=False)
    assert tokenizer.decode(ids) == episode and len(ids) == 1 + 7 + 1 + 1 + 6 + 1 + 1 + 6
    assert tokenizer.pad_token_id not in ids  # nothing unknown
    # Beside a Qwen2 config.json, AutoTokenizer would read it as Qwen2's and split the tags:
    # why the demo's tokenizer has a folder of its own.
    (tmp_path / "tokenizer" / "config.json").write_text(json.dumps(prepare.RECIPE["model"]))
    beside = load_tokenizer(DataConfig(tokenizer=str(tmp_path / "tokenizer")), None)
    assert beside.encode(episode, add_special_tokens=False) != ids

    rows = {
        name: [json.loads(line) for line in (tmp_path / "data" / f"{name}.jsonl").read_text().splitlines()]
        for name in ("train", "val")
    }
    prompts = {name: {row["prompt"][0]["content"] for row in rows[name]} for name in rows}
    assert (len(prompts["train"]), len(prompts["val"])) == (1000, 100) and not prompts["train"] & prompts["val"]
    for row in rows["val"]:
        a, b = map(int, row["prompt"][0]["content"].rstrip("=").split("*"))
        assert 100 <= a < 1000 and 100 <= b < 1000 and row["reward_model"]["ground_truth"] == str(a * b)
    assert dapo_math_reward(episode, str(983 * 969)).correct
