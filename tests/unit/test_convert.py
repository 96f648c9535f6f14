"""HF <-> Megatron conversion: bitwise round trips, verification, and every refusal."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dapo_megatron.ckpt import convert as convert_module
from dapo_megatron.ckpt import mapping
from dapo_megatron.ckpt.convert import ConversionError, hf_to_megatron, megatron_to_hf
from dapo_megatron.ckpt.dcp_io import ChunkSpec, checkpoint_problem, read_chunk, tensor_shapes, write_dist_checkpoint


def make_hf(path: Path, *, tied=False, vocab=250, layers=3, dtype=torch.float32, max_shard_size=None, seed=0) -> Path:
    """A tiny random Qwen2ForCausalLM saved the way transformers saves it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        max_position_embeddings=128,
    )
    model = Qwen2ForCausalLM(config).to(dtype)
    # Random biases (they start at zero) so a bias mapping mistake cannot hide.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    (path / "tokenizer.json").write_text("{}")
    return path


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize(
    ("tied", "vocab", "dtype"),
    [(False, 256, torch.float32), (True, 256, torch.float32), (False, 250, torch.float32), (True, 250, torch.bfloat16)],
)
def test_round_trip_is_bitwise(tmp_path, tied, vocab, dtype):
    hf = make_hf(tmp_path / "hf", tied=tied, vocab=vocab, dtype=dtype)
    report = hf_to_megatron(hf, tmp_path / "mg", verify=True, progress=False)
    assert report.verified and report.max_logit_error < 1e-5
    stored = tensor_shapes(tmp_path / "mg")
    assert ("output_layer.weight" in stored) is (not tied)
    assert stored["embedding.word_embeddings.weight"] == ((vocab, 64), dtype)
    assert stored["decoder.layers.self_attention.linear_qkv.weight"] == ((3, (8 + 2 * 2) * 8, 64), dtype)
    back = megatron_to_hf(tmp_path / "mg", hf, tmp_path / "back", verify=True, progress=False)
    assert back.verified
    original, converted = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert sorted(original) == sorted(converted)
    for name, tensor in original.items():
        assert converted[name].dtype == tensor.dtype and torch.equal(converted[name], tensor), name
    assert (tmp_path / "back" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"] is tied
    assert not list(tmp_path.glob("*.tmp-*"))


def make_hf_qwen3(path: Path, *, tied: bool, seed: int = 0) -> Path:
    """A tiny random Qwen3ForCausalLM (head_dim 16, not hidden / heads = 8), its q/k
    norms away from 1 so a mapping mistake in them cannot hide."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=250,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
        max_position_embeddings=128,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_round_trip_is_bitwise_and_verified(tmp_path, tied):
    hf = make_hf_qwen3(tmp_path / "hf", tied=tied)
    report = hf_to_megatron(hf, tmp_path / "mg", verify=True, progress=False)
    assert report.verified and report.max_logit_error < 1e-5
    stored = tensor_shapes(tmp_path / "mg")
    assert stored["decoder.layers.self_attention.q_layernorm.weight"] == ((2, 16), torch.float32)
    assert stored["decoder.layers.self_attention.linear_qkv.weight"] == ((2, (8 + 2 * 2) * 16, 64), torch.float32)
    assert "decoder.layers.self_attention.linear_qkv.bias" not in stored
    megatron_to_hf(tmp_path / "mg", hf, tmp_path / "back", verify=True, progress=False)
    original, converted = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert sorted(original) == sorted(converted)
    assert all(torch.equal(converted[name], tensor) for name, tensor in original.items())


def test_a_swapped_qwen3_qk_norm_fails_verification(tmp_path, monkeypatch):
    hf = make_hf_qwen3(tmp_path / "hf", tied=False)
    swapped = dict(mapping._ALL_LAYER_PARAMS)
    swapped[mapping.QK_NORMS[0]], swapped[mapping.QK_NORMS[1]] = (
        swapped[mapping.QK_NORMS[1]],
        swapped[mapping.QK_NORMS[0]],
    )
    monkeypatch.setattr(mapping, "_ALL_LAYER_PARAMS", swapped)
    with pytest.raises(ConversionError, match="verification failed"):
        hf_to_megatron(hf, tmp_path / "mg", verify=True, progress=False)
    assert not (tmp_path / "mg").exists()


def make_hf_qwen3_moe(
    path: Path, *, tied: bool, norm_topk_prob: bool = True, seed: int = 0, mlp_only_layers=(), layers: int = 2
) -> Path:
    """A tiny random Qwen3MoeForCausalLM (2 layers of 4 experts, top 2), with router
    weights large enough that the routing is far from ties."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=250,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
        max_position_embeddings=128,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 1.0)
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(("tied", "norm_topk_prob"), [(False, True), (True, False)])
def test_qwen3_moe_round_trip_is_bitwise_and_verified(tmp_path, tied, norm_topk_prob):
    """Both routers (renormalised top-k, and the full softmax's top-k) verify against
    transformers' logits; experts are stored as megatron stores them."""
    hf = make_hf_qwen3_moe(tmp_path / "hf", tied=tied, norm_topk_prob=norm_topk_prob)
    report = hf_to_megatron(hf, tmp_path / "mg", verify=True, progress=False)
    assert report.verified and report.max_logit_error < 1e-5
    stored = tensor_shapes(tmp_path / "mg")
    assert stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == ((2, 4, 48, 64), torch.float32)
    assert stored["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == ((2, 4, 64, 24), torch.float32)
    assert stored["decoder.layers.mlp.router.weight"] == ((2, 4, 64), torch.float32)
    assert "decoder.layers.mlp.linear_fc1.weight" not in stored
    fc1 = read_chunk(
        tmp_path / "mg",
        "decoder.layers.mlp.experts.experts.linear_fc1.weight",
        (1, 2, 0, 0),
        (1, 1, 48, 64),
        torch.float32,
    )[0, 0]
    tensors = hf_tensors(hf)
    assert torch.equal(fc1[:24], tensors["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(fc1[24:], tensors["model.layers.1.mlp.experts.2.up_proj.weight"])
    megatron_to_hf(tmp_path / "mg", hf, tmp_path / "back", verify=True, progress=False)
    converted = hf_tensors(tmp_path / "back")
    assert sorted(tensors) == sorted(converted)
    assert all(torch.equal(converted[name], tensor) for name, tensor in tensors.items())


def test_qwen3_moe_with_a_dense_layer_round_trips_under_per_layer_keys(tmp_path):
    """``mlp_only_layers``: megatron stores such a model's layers under keys of their own
    (``decoder.layers.<i>.<name>``); layer 1 keeps a dense MLP, layers 0 and 2 have experts."""
    hf = make_hf_qwen3_moe(tmp_path / "hf", tied=False, mlp_only_layers=[1], layers=3)
    report = hf_to_megatron(hf, tmp_path / "mg", verify=True, progress=False)
    assert report.verified and report.max_logit_error < 1e-5
    stored = tensor_shapes(tmp_path / "mg")
    assert stored["decoder.layers.1.mlp.linear_fc1.weight"] == ((2 * 96, 64), torch.float32)
    assert stored["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"] == ((4, 48, 64), torch.float32)
    assert "decoder.layers.1.mlp.router.weight" not in stored and "decoder.layers.2.mlp.router.weight" in stored
    assert not any(key.startswith("decoder.layers.self_attention") for key in stored)
    megatron_to_hf(tmp_path / "mg", hf, tmp_path / "back", verify=True, progress=False)
    tensors, converted = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert "model.layers.1.mlp.gate_proj.weight" in tensors and sorted(tensors) == sorted(converted)
    assert all(torch.equal(converted[name], tensor) for name, tensor in tensors.items())


def test_swapped_experts_or_gate_and_up_fail_verification(tmp_path, monkeypatch):
    hf = make_hf_qwen3_moe(tmp_path / "hf", tied=False)
    original = mapping.to_megatron

    def swapping_experts(key, hf_tensors, shape):
        tensor = original(key, hf_tensors, shape)
        return tensor[[1, 0, 2, 3]] if key.endswith("experts.linear_fc2.weight") else tensor

    monkeypatch.setattr(convert_module, "to_megatron", swapping_experts)
    with pytest.raises(ConversionError, match="verification failed"):
        hf_to_megatron(hf, tmp_path / "mg", verify=True, progress=False)
    assert not (tmp_path / "mg").exists()
    swapped = dict(mapping._ALL_LAYER_PARAMS)
    swapped[mapping.EXPERT_FC1] = tuple(reversed(swapped[mapping.EXPERT_FC1]))  # [up; gate]
    monkeypatch.setattr(convert_module, "to_megatron", original)
    monkeypatch.setattr(mapping, "_ALL_LAYER_PARAMS", swapped)
    with pytest.raises(ConversionError, match="verification failed"):
        hf_to_megatron(hf, tmp_path / "mg", verify=True, progress=False)


def test_qkv_layout_is_grouped_per_query_group(tmp_path):
    hf = make_hf(tmp_path / "hf", layers=1)
    hf_to_megatron(hf, tmp_path / "mg", verify=False, progress=False)
    fused = read_chunk(
        tmp_path / "mg", "decoder.layers.self_attention.linear_qkv.weight", (0, 0, 0), (1, 96, 64), torch.float32
    )[0]
    tensors = hf_tensors(hf)
    q, k, v = (tensors[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    # Group 0: query heads 0-3 (32 rows), then key head 0, then value head 0; group 1 follows.
    assert torch.equal(fused[:32], q[:32]) and torch.equal(fused[32:40], k[:8]) and torch.equal(fused[40:48], v[:8])
    assert torch.equal(fused[48:80], q[32:]) and torch.equal(fused[80:88], k[8:]) and torch.equal(fused[88:], v[8:])
    fc1 = read_chunk(tmp_path / "mg", "decoder.layers.mlp.linear_fc1.weight", (0, 0, 0), (1, 192, 64), torch.float32)[0]
    assert torch.equal(fc1[:96], tensors["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], tensors["model.layers.0.mlp.up_proj.weight"])


def test_sharded_input_and_output_with_index(tmp_path):
    hf = make_hf(tmp_path / "hf", max_shard_size="100KB")
    assert (hf / "model.safetensors.index.json").exists()
    hf_to_megatron(hf, tmp_path / "mg", verify=False, progress=False)
    megatron_to_hf(tmp_path / "mg", hf, tmp_path / "back", max_shard_bytes=100_000, verify=False, progress=False)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    original, converted = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert all(torch.equal(converted[k], v) for k, v in original.items()) and sorted(original) == sorted(converted)


def test_a_wrong_mapping_fails_verification_and_keeps_nothing(tmp_path, monkeypatch):
    hf = make_hf(tmp_path / "hf")

    def concatenated(q, k, v, shape):  # HF order instead of Megatron's per-group interleave
        return torch.cat([q, k, v], dim=0)

    monkeypatch.setattr(mapping, "interleave_qkv", concatenated)
    with pytest.raises(ConversionError, match="verification failed: Megatron and transformers logits differ"):
        hf_to_megatron(hf, tmp_path / "mg", verify=True, progress=False)
    assert not (tmp_path / "mg").exists() and not list(tmp_path.glob("mg*"))


@pytest.mark.parametrize("direction", ["megatron-to-hf", "hf-to-megatron"])
def test_fp32_to_bf16_conversion_is_verified_exactly(tmp_path, monkeypatch, direction):
    """Rounding to bf16 moves logits by ~1e-3; verification rounds both sides, so it passes at 1e-5."""
    hf = make_hf(tmp_path / "hf")
    hf_to_megatron(hf, tmp_path / "mg", verify=False, progress=False)
    original = hf_tensors(hf)
    if direction == "megatron-to-hf":
        report = megatron_to_hf(
            tmp_path / "mg", hf, tmp_path / "out", dtype=torch.bfloat16, verify=True, progress=False
        )
        written = hf_tensors(tmp_path / "out")
        for name, tensor in original.items():
            assert written[name].dtype == torch.bfloat16 and torch.equal(written[name], tensor.to(torch.bfloat16))
    else:
        report = hf_to_megatron(hf, tmp_path / "out", dtype=torch.bfloat16, verify=True, progress=False)
        norm = read_chunk(tmp_path / "out", mapping.FINAL_NORM, (0,), (64,), torch.bfloat16)
        assert tensor_shapes(tmp_path / "out")[mapping.FINAL_NORM] == ((64,), torch.bfloat16)
        assert torch.equal(norm, original["model.norm.weight"].to(torch.bfloat16))
    assert report.verified and report.max_logit_error < 1e-5

    # A mapping error smaller than the rounding's effect on the logits is still caught.
    mapped = convert_module.to_megatron

    def skewed(key, tensors, shape):
        tensor = mapped(key, tensors, shape)
        return tensor * 1.01 if key == mapping.FINAL_NORM else tensor

    monkeypatch.setattr(convert_module, "to_megatron", skewed)
    with pytest.raises(ConversionError, match="verification failed"):
        hf_to_megatron(hf, tmp_path / "skewed", dtype=torch.bfloat16, verify=True, progress=False)


@pytest.fixture(scope="module")
def converted_by_the_cli(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """``python -m dapo_megatron convert hf-to-megatron --quiet`` of a tiny Qwen2 (verified
    by default), with every library warning shown: the HF folder, the output and the run."""
    root = tmp_path_factory.mktemp("cli")
    hf = make_hf(root / "hf")
    done = subprocess.run(
        [sys.executable, "-m", "dapo_megatron", "convert", "hf-to-megatron", "--hf-dir", str(hf)]
        + ["--out", str(root / "mg"), "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    return hf, root / "mg", done


def _only_the_summary(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stderr
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("wrote ") and "verified against transformers" in lines[0], lines


def test_quiet_prints_the_summary_only(tmp_path, converted_by_the_cli):
    hf, mg, done = converted_by_the_cli
    _only_the_summary(done)
    back = subprocess.run(
        [sys.executable, "-m", "dapo_megatron", "convert", "megatron-to-hf", "--ckpt", str(mg)]
        + ["--hf-config", str(hf), "--out", str(tmp_path / "back"), "--quiet", "--verify"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    _only_the_summary(back)


def test_progress_without_quiet_carries_no_library_warnings(tmp_path):
    """Without ``--quiet`` the output is the progress bars (tqdm's carriage-return
    updates) and the summary line; nothing the libraries warn about in between."""
    hf = make_hf(tmp_path / "hf")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_megatron",
            "convert",
            "hf-to-megatron",
            "--hf-dir",
            str(hf),
            "--out",
            str(tmp_path / "mg"),
            "--verify",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert done.returncode == 0, done.stderr
    pieces = [piece.strip() for line in (done.stdout + done.stderr).splitlines() for piece in line.split("\r")]
    pieces = [piece for piece in pieces if piece]
    assert pieces[-1].startswith("wrote ") and "verified against transformers" in pieces[-1]
    others = [piece for piece in pieces[:-1] if not piece.startswith("hf->megatron:")]
    assert others == [], others
    assert not any("warn" in piece.lower() for piece in pieces), pieces


def test_unsupported_architecture(tmp_path):
    hf = make_hf(tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConversionError, match=r"unsupported model family 'llama' .*; supported: qwen2 \(Qwen2ForCausalLM\), qwen3"
    ):
        hf_to_megatron(hf, tmp_path / "mg", progress=False)


def _rewrite(hf: Path, change) -> None:
    tensors = load_file(hf / "model.safetensors")
    change(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


def test_missing_extra_and_misshaped_tensors_are_named(tmp_path):
    hf = make_hf(tmp_path / "hf")
    _rewrite(hf, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConversionError, match="missing tensors: model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(hf, tmp_path / "mg", progress=False)

    hf = make_hf(tmp_path / "hf2")
    _rewrite(hf, lambda t: t.update({"model.layers.0.self_attn.rogue.weight": torch.zeros(2)}))
    with pytest.raises(ConversionError, match="unexpected tensors: model.layers.0.self_attn.rogue.weight"):
        hf_to_megatron(hf, tmp_path / "mg", progress=False)

    hf = make_hf(tmp_path / "hf3")
    _rewrite(hf, lambda t: t.update({"model.layers.2.self_attn.o_proj.weight": torch.zeros(64, 32)}))
    with pytest.raises(
        ConversionError,
        match=r"tensor model.layers.2.self_attn.o_proj.weight has shape \(64, 32\), but config.json implies \(64, 64\)",
    ):
        hf_to_megatron(hf, tmp_path / "mg", progress=False)
    assert not list(tmp_path.glob("mg*"))


def test_config_and_checkpoint_disagree(tmp_path):
    hf = make_hf(tmp_path / "hf", layers=3)
    hf_to_megatron(hf, tmp_path / "mg", verify=False, progress=False)
    other = make_hf(tmp_path / "other", layers=2)
    with pytest.raises(
        ConversionError, match=r"has 3 layers .* says num_hidden_layers=2; the config and the checkpoint disagree"
    ):
        megatron_to_hf(tmp_path / "mg", other, tmp_path / "back", progress=False)
    tied = make_hf(tmp_path / "tied", tied=True)
    with pytest.raises(ConversionError, match="has an output_layer.weight but .* says tie_word_embeddings=true"):
        megatron_to_hf(tmp_path / "mg", tied, tmp_path / "back", progress=False)
    # An HF config that is tied while the HF checkpoint has its own lm_head.
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ConversionError, match="unexpected tensors: lm_head.weight .*tie_word_embeddings=true"):
        hf_to_megatron(hf, tmp_path / "mg2", progress=False)
    with pytest.raises(ConversionError, match="is not a Megatron dist checkpoint"):
        megatron_to_hf(tmp_path / "other", other, tmp_path / "back", progress=False)


def test_existing_output_is_refused_and_overwrite_replaces_only_after_success(tmp_path, monkeypatch):
    hf = make_hf(tmp_path / "hf")
    (tmp_path / "mg").mkdir()
    (tmp_path / "mg" / "precious.txt").write_text("keep me")
    with pytest.raises(
        ConversionError, match="output folder .*mg already exists; choose another --out or pass --overwrite"
    ):
        hf_to_megatron(hf, tmp_path / "mg", progress=False)
    # A failing overwrite leaves the old folder as it was.
    monkeypatch.setattr(mapping, "interleave_qkv", lambda q, k, v, shape: torch.cat([q, k, v]))
    with pytest.raises(ConversionError, match="verification failed"):
        hf_to_megatron(hf, tmp_path / "mg", overwrite=True, verify=True, progress=False)
    assert (tmp_path / "mg" / "precious.txt").read_text() == "keep me"
    monkeypatch.undo()
    hf_to_megatron(hf, tmp_path / "mg", overwrite=True, verify=True, progress=False)
    assert not (tmp_path / "mg" / "precious.txt").exists() and (tmp_path / "mg" / "metadata.json").exists()


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.rglob("*") if f.is_file()
    }


def test_overwrite_refuses_an_output_that_is_or_contains_the_input(tmp_path):
    """Publishing replaces ``--out`` whole; were an input ``--out`` itself or inside it, a
    successful ``--overwrite`` conversion would delete it. Refused before anything is written."""
    models = tmp_path / "models"
    hf = make_hf(models / "hf", layers=1)
    saves = tmp_path / "saves"
    hf_to_megatron(hf, saves / "step_1", verify=False, progress=False)
    (saves / "latest").write_text(json.dumps({"path": "step_1"}))
    before = {"hf": _digests(hf), "saves": _digests(saves)}
    cases = [
        (lambda out: hf_to_megatron(hf, out, overwrite=True, progress=False), hf, hf, "is"),
        (lambda out: hf_to_megatron(hf, out, overwrite=True, progress=False), models, hf, "contains"),
        (
            lambda out: megatron_to_hf(saves / "step_1", hf, out, overwrite=True, progress=False),
            saves / "step_1",
            saves / "step_1",
            "is",
        ),
        (lambda out: megatron_to_hf(saves, hf, out, overwrite=True, progress=False), saves, saves, "is"),
        (lambda out: megatron_to_hf(saves, hf, out, overwrite=True, progress=False), tmp_path, saves, "contains"),
        # --out inside the save folder, but it is the checkpoint the folder's `latest` names.
        (lambda out: megatron_to_hf(saves, hf, out, overwrite=True, progress=False), saves / "step_1", saves, "is"),
        # The HF config folder is an input too (config.json and tokenizer files are copied from it).
        (lambda out: megatron_to_hf(saves, hf, out, overwrite=True, progress=False), hf, hf, "is"),
        (
            lambda out: megatron_to_hf(saves, hf / "config.json", out, overwrite=True, progress=False),
            hf,
            hf,
            "contains",
        ),
    ]
    for convert, out, source, relation in cases:
        with pytest.raises(
            ConversionError,
            match=rf"output folder {re.escape(str(out))} {relation} the input .*{re.escape(str(source))}.*; "
            "replacing it would delete the input: choose an --out outside",
        ):
            convert(out)
        assert {"hf": _digests(hf), "saves": _digests(saves)} == before
        assert not list(out.parent.glob(f"{out.name}.tmp-*")) and not list(out.parent.glob(f"{out.name}.old-*"))
    # An output inside an input loses nothing: the input's own files stay as they were.
    megatron_to_hf(saves, hf, saves / "hf", overwrite=True, verify=False, progress=False)
    assert {k: v for k, v in _digests(saves).items() if not k.startswith("hf/")} == before["saves"]


def test_cli_round_trip_and_exit_status(tmp_path, converted_by_the_cli):
    hf, mg, ok = converted_by_the_cli
    assert ok.returncode == 0, ok.stderr
    assert "verified against transformers" in ok.stderr
    again = subprocess.run(
        [sys.executable, "-m", "dapo_megatron", "convert", "hf-to-megatron", "--hf-dir", str(hf)]
        + ["--out", str(mg), "--quiet"],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "already exists" in again.stderr
    tool = subprocess.run(
        [
            sys.executable,
            "tools/convert_ckpt/megatron_to_hf.py",
            "--ckpt",
            str(mg),
            "--hf-config",
            str(hf),
            "--out",
            str(tmp_path / "back"),
            "--quiet",
            "--no-verify",
            "--dtype",
            "bfloat16",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert tool.returncode == 0, tool.stderr
    assert "not verified" in tool.stderr
    assert hf_tensors(tmp_path / "back")["model.norm.weight"].dtype == torch.bfloat16


class _CreatesAFile:
    """Pickles as a call of ``open(path, "w")``: unpickling it creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_integrity_check_does_not_run_code_from_common_pt(tmp_path):
    ckpt = tmp_path / "ckpt"
    chunk = ChunkSpec("w", (2, 3), (0, 0), (2, 3), torch.float32, lambda: torch.ones(2, 3))
    write_dist_checkpoint(ckpt, [chunk])
    # What megatron writes there (the run's checkpoints): plain dicts, numbers, strings, tensors.
    common = {
        "layout": {"tp_size": 1, "pp_size": 1, "ep_size": 1},
        "rollout_step": 3,
        "scheduler": {"max_lr": 1e-6, "num_steps": 3, "lr_decay_style": "constant"},
        "optimizer": {"optimizer": {"param_groups": [{"betas": (0.9, 0.99), "foreach": None, "step": 3.0}]}},
        "extra": torch.arange(4),
    }
    torch.save(common, ckpt / "common.pt")
    assert checkpoint_problem(ckpt) is None
    # Megatron-LM's own saves add an argparse.Namespace, one of the classes megatron
    # registers as safe; its load allows it, so the check does too.
    torch.save({**common, "args": argparse.Namespace(lr=1e-6)}, ckpt / "common.pt")
    assert checkpoint_problem(ckpt) is None
    marker = tmp_path / "marker"
    torch.save({**common, "payload": _CreatesAFile(str(marker))}, ckpt / "common.pt")
    problem = checkpoint_problem(ckpt)
    assert not marker.exists(), "checkpoint_problem ran code from common.pt"
    assert problem is not None and problem.startswith(f"{ckpt / 'common.pt'} cannot be loaded safely")
