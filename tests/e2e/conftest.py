"""A tiny model with the demo's tokenizer and task, shared by the end-to-end tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _demo_prepare():
    spec = importlib.util.spec_from_file_location("demo_prepare", REPO / "examples/demo/prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_task_with(root: Path, make_config) -> Path:
    """The demo's tokenizer and task in ``root``, and a random model of the config that
    ``make_config(vocab_size, eos_token_id)`` returns in ``root / "model"``."""
    from transformers import AutoModelForCausalLM

    prepare = _demo_prepare()
    tokenizer = prepare.build_tokenizer(root / "model")
    prepare.write_task(root / "data")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config(len(prepare.VOCAB), tokenizer.eos_token_id)).save_pretrained(
        root / "model"
    )
    return root


_TINY = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random tiny Qwen2 with the demo's tokenizer, and the demo's addition task."""
    from transformers import Qwen2Config

    return _demo_task_with(
        tmp_path_factory.mktemp("e2e"),
        lambda vocab, eos: Qwen2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, eos_token_id=eos, **_TINY
        ),
    )


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """A random tiny Qwen3-MoE (2 layers of 4 experts, top 2) with the demo's tokenizer and task."""
    from transformers import Qwen3MoeConfig

    return _demo_task_with(
        tmp_path_factory.mktemp("e2e_moe"),
        lambda vocab, eos: Qwen3MoeConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            head_dim=16,
            eos_token_id=eos,
            **_TINY,
        ),
    )


def run_config(root: Path, out: Path, **overrides) -> dict:
    config = {
        "model": {"hf_config": str(root / "model"), "make_vocab_size_divisible_by": 8},
        "parallel": {"device": "cpu", "num_devices_per_node": 2, "tp_size": 2},
        "rollout": {
            "engine": "hf",
            "n_samples_per_prompt": 4,
            "temperature": 0.7,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "val_n_samples": 2,
            "val_top_p": 1.0,
        },
        "algorithm": {"overlong_buffer_len": 2, "reward_fn": "tests.e2e.rewards:mixed_for_even_answers"},
        "data": {
            "train_files": [str(root / "data/train.jsonl")],
            "val_files": [str(root / "data/val.jsonl")],
            "train_batch_size": 4,
            "gen_batch_size": 4,
            "mini_batch_size": 8,
        },
        "trainer": {
            "num_steps": 2,
            "lr": 1e-3,
            "lr_warmup_steps": 0,
            "micro_batch_max_tokens": 64,
            "output_dir": str(out),
        },
        "checkpoint": {"save_every": 2, "export_hf": False},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        config[section][key] = value
    return config
