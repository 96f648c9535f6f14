"""Conversion throughput and peak memory on a synthetic Qwen2-shaped checkpoint (>= 4 GB).

Run: ``.venv/bin/python benchmarks/bench_convert.py [--workdir DIR] [--layers 24]``.

1. writes a random bf16 Qwen2 checkpoint with safetensors (2 GiB shards, Qwen2.5-3B-like
   widths: hidden 2048, 16 heads, 2 KV heads, ffn 11008, vocab 151936, untied);
2. copies its files with ``shutil.copytree`` (the plain-copy anchor, same disk);
3. converts HF -> Megatron and Megatron -> HF, each in a fresh process that reports its
   own peak RSS.

Prints wall time, throughput, the ratio to the plain copy, and peak RSS relative to the
checkpoint size. Logit verification is off here (a 5 GB model in fp32 on 2 cores); the
tests verify small models.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _write_checkpoint(path: Path, layers: int) -> int:
    import torch
    from safetensors.torch import save_file

    hidden, heads, kv_heads, ffn, vocab = 2048, 16, 2, 11008, 151936
    head_dim = hidden // heads
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.q_proj.bias": (hidden,),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.k_proj.bias": (kv_heads * head_dim,),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.bias": (kv_heads * head_dim,),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (ffn, hidden),
                p + "mlp.up_proj.weight": (ffn, hidden),
                p + "mlp.down_proj.weight": (hidden, ffn),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, shard_bytes, files, total = {}, {}, 0, [], 0

    def flush():
        nonlocal shard, shard_bytes
        name = f"shard-{len(files)}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        files.append(name)
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        tensor = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if shard and shard_bytes + tensor.nbytes > 2 * 2**30:
            flush()
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        total += tensor.nbytes
    flush()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def _child(direction: str, source: str, out: str, hf_config: str) -> None:
    from dapo_megatron.ckpt.convert import hf_to_megatron, megatron_to_hf

    start = time.perf_counter()
    if direction == "hf-to-megatron":
        report = hf_to_megatron(source, out, verify=False, progress=False)
    else:
        report = megatron_to_hf(source, hf_config, out, verify=False, progress=False)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": elapsed, "peak_rss": peak, "bytes": report.num_bytes}))


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one, removed after)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        hf = work / "hf"
        t0 = time.perf_counter()
        size = _write_checkpoint(hf, args.layers)
        print(
            f"synthetic checkpoint: {size / 2**30:.2f} GiB of tensors ({_dir_bytes(hf) / 2**30:.2f} GiB on disk), "
            f"written in {time.perf_counter() - t0:.1f} s"
        )
        start = time.perf_counter()
        shutil.copytree(hf, work / "copy")
        copy_seconds = time.perf_counter() - start
        copy_rate = _dir_bytes(hf) / copy_seconds
        print(f"plain copy: {copy_seconds:.1f} s, {copy_rate / 2**30:.2f} GiB/s")
        shutil.rmtree(work / "copy")
        runs = [("hf-to-megatron", hf, work / "mg"), ("megatron-to-hf", work / "mg", work / "back")]
        for direction, source, out in runs:
            result = subprocess.run(
                [sys.executable, __file__, "--child", direction, str(source), str(out), str(hf)],
                check=True,
                capture_output=True,
                text=True,
            )
            r = json.loads(result.stdout.strip().splitlines()[-1])
            rate = r["bytes"] / r["seconds"]
            print(
                f"{direction}: {r['seconds']:.1f} s, {rate / 2**30:.2f} GiB/s = {rate / copy_rate:.2f}x the plain copy; "
                f"peak RSS {r['peak_rss'] / 2**30:.2f} GiB = {r['peak_rss'] / size:.2f}x the checkpoint"
            )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
