"""``dapo-megatron eval`` against a hand count, on a model whose answers are known."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from dapo_megatron import cli
from dapo_megatron.ckpt.convert import hf_to_megatron
from tests.e2e.conftest import joined, run_config


def _bigram_model(tokenizer_dir: Path, out: Path, answer: str) -> None:
    """A Qwen2 whose layers add nothing (all zero), so the next token depends only on the
    current one through the output layer: ``=`` -> ``Answer: `` -> ``answer`` -> EOS. Greedy,
    it answers every problem with ``answer``."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        for parameter in model.model.layers.parameters():
            parameter.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, 32))  # one-hot: RMSNorm keeps the direction
        model.lm_head.weight.zero_()
        for current, following in (("=", "Answer: "), ("Answer: ", answer), (answer, "<eos>")):
            model.lm_head.weight[ids(following), ids(current)] = 10.0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _val_file(path: Path) -> None:
    """The 100 problems a+b, each written three times; the source says whether a < 5."""
    rows = [
        {
            "data_source": "low" if a < 5 else "high",
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "reward_model": {"ground_truth": str(a + b)},
        }
        for a in range(10)
        for b in range(10)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows * 3))


@pytest.mark.timeout(600)
def test_eval_reports_a_hand_computed_avg_and_pass_at_k(tiny_model, tmp_path, capsys, shared_ray):
    _bigram_model(tiny_model / "model", tmp_path / "bigram", answer="7")
    _val_file(tmp_path / "val.jsonl")
    config = run_config(tiny_model, tmp_path / "run")
    config["model"]["hf_config"] = str(tmp_path / "bigram")
    config["data"]["val_files"] = [str(tmp_path / "val.jsonl")]
    config["algorithm"]["reward_fn"] = "dapo_math"
    config["rollout"].update(val_n_samples=4, val_temperature=0.0)
    config["parallel"].update(tp_size=1, num_devices_per_node=1)
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(joined(config, shared_ray)))

    # "Answer: 7" is right exactly when a + b = 7: a = 0..7, five with a < 5, three above.
    expected = {"overall": (100, 8 / 100), "low": (50, 5 / 50), "high": (50, 3 / 50)}
    runs = {"hf": ["--hf-dir", str(tmp_path / "bigram")]}
    hf_to_megatron(tmp_path / "bigram", tmp_path / "megatron", verify=False, progress=False)
    runs["megatron"] = ["--ckpt", str(tmp_path / "megatron")]
    for name, source in runs.items():
        out = tmp_path / f"eval_{name}"
        assert cli.main(["eval", str(path), *source, "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        summary = json.loads((out / "summary.json").read_text())
        assert summary["k"] == 4 and summary["rows_read"] == 300 and summary["repeated_rows_counted_once"] == 200
        scores = {"overall": summary["overall"], **summary["by_source"]}
        for key, (problems, accuracy) in expected.items():
            assert scores[key]["problems"] == problems, (name, key)
            # Greedy: all 4 samples of a problem agree, so avg@4 = pass@4.
            assert scores[key]["avg_at_k"] == pytest.approx(accuracy) == scores[key]["pass_at_k"], (name, key)
        records = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
        assert len(records) == 100 and all(r["predictions"] == ["7"] * 4 for r in records)
        assert sum(r["solved"] for r in records) == 8
        assert "avg@4" in printed and "8.0%" in printed and "200 repeats counted once" in printed
    with pytest.raises(SystemExit):
        cli.main(["eval", str(path)])  # neither --ckpt nor --hf-dir
    shutil.rmtree(tmp_path / "megatron")
