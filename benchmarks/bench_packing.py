"""Packed sequences vs padded rows: the actor's log-prob pass and update, side by side.

Run: ``.venv/bin/python benchmarks/bench_packing.py [--repeats 3] [--json FILE]``.

The workload: ``--sequences`` sequences of a ``--prompt``-token prompt and a response
whose length is log-uniform between ``--min-response`` and ``--max-response`` (100x
apart, so the longest is about 10x the median: DAPO's long tail); the script prints the
measured median and maximum. One actor rank (megatron's GPTModel on the CPU, local spec,
fp32), a model of ``--layers`` layers of width ``--hidden``, and a token budget of
``--budget`` per micro-batch. Each repeat times, for padded rows and then for packed
sequences, ``compute_log_probs`` over the batch and one ``train`` step (one update),
from the same weights (the learning rate is 1e-9). Reported per mode: the median time
of each phase and its range, the padding share of the tokens the actor runs, and the
FLOP formula's prediction (``dapo_megatron/bench/flops.py``) for the CPU (megatron's
local attention computes the full square of each padded row, or of each sequence of a
packed row) and for a GPU (causal kernels: each row's or sequence's own triangle).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def lengths_of(args) -> list[int]:
    """Response lengths at the quantiles ``(i + 1/2) / n`` of the log-uniform law between
    the bounds (the longest about 10x the median when the bounds are 100x apart), in a
    seeded shuffled order."""
    low, high = math.log(args.min_response), math.log(args.max_response)
    n = args.sequences
    lengths = [int(round(math.exp(low + (high - low) * (i + 0.5) / n))) for i in range(n)]
    random.Random(args.seed).shuffle(lengths)
    return lengths


def cpu_model() -> str:
    """The machine's CPU, as /proc/cpuinfo names it (or the platform's word for it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def config_for(args):
    from dapo_megatron.config import config_from_dict

    return config_from_dict(
        {
            "model": {
                "num_layers": args.layers,
                "hidden_size": args.hidden,
                "ffn_hidden_size": 3 * args.hidden,
                "num_attention_heads": args.hidden // 64,
                "num_query_groups": max(1, args.hidden // 128),
                "vocab_size": args.vocab,
                "make_vocab_size_divisible_by": 8,
                "max_position_embeddings": args.budget,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1e6,
                "tie_word_embeddings": False,
                "params_dtype": "float32",
                "transformer_impl": "local",
            },
            "parallel": {"device": "cpu", "tp_size": 1, "pp_size": 1},
            "rollout": {"max_prompt_length": args.prompt, "max_response_length": args.max_response},
            "algorithm": {"overlong_buffer_enable": False},
            "trainer": {"micro_batch_max_tokens": args.budget, "lr": 1e-9, "lr_warmup_steps": 0},
        }
    )


def batch_of(args, responses: list[int]):
    from dapo_megatron.actor.batch import PolicyBatch

    gen = torch.Generator().manual_seed(args.seed)
    rows, width = len(responses), args.prompt + max(responses)
    return PolicyBatch(
        tokens=torch.randint(0, args.vocab, (rows, width), generator=gen),
        prompt_lengths=torch.full((rows,), args.prompt),
        response_lengths=torch.tensor(responses),
        advantages=torch.randn(rows, generator=gen),
    )


def predictions(cfg, actor, batch) -> dict:
    """Training FLOPs of one update (three forwards) as each layout computes them."""
    from dapo_megatron.bench.flops import train_flops
    from dapo_megatron.ckpt.mapping import ModelShape

    shape = ModelShape.from_model_config(cfg.model)
    micro = actor._micro_batches(batch)
    logits = int(batch.response_mask().sum())
    rows = [mb.tokens.shape[1] for mb in micro for _ in range(mb.tokens.shape[0])]
    sequences = batch.seq_lengths.tolist()
    return {
        # Both specs attend per sequence when packed (padded: per row); megatron's local
        # attention computes each square whole, causal kernels only its triangle.
        "cpu_flops": train_flops(shape, sequences if cfg.trainer.pack_sequences else rows, logits, causal=False),
        "gpu_flops": train_flops(shape, sequences if cfg.trainer.pack_sequences else rows, logits, causal=True),
        "micro_batches": len(micro),
    }


def measure(args) -> dict:
    from dapo_megatron.actor.megatron_actor import MegatronActor
    from dapo_megatron.runtime.distributed import megatron_runtime

    torch.set_num_threads(args.threads)
    responses = lengths_of(args)
    cfg = config_for(args)
    modes = {"padded rows": False, "packed": True}
    results: dict[str, dict] = {name: {"log_prob_s": [], "train_s": []} for name in modes}
    with megatron_runtime(cfg.parallel, seed=cfg.trainer.seed) as info:
        actors = {}
        for name, pack in modes.items():
            trainer = dataclasses.replace(cfg.trainer, pack_sequences=pack)  # an actor keeps its config
            torch.manual_seed(0)
            actors[name] = MegatronActor(cfg.model, cfg.parallel, trainer, cfg.algorithm, info)
            results[name].update(
                predictions(dataclasses.replace(cfg, trainer=trainer), actors[name], batch_of(args, responses))
            )
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            for name, actor in actors.items():
                batch = batch_of(args, responses)
                start = time.perf_counter()
                batch.old_log_probs, _ = actor.compute_log_probs(batch)
                log_prob_s = time.perf_counter() - start
                start = time.perf_counter()
                metrics = actor.train(batch)[0]
                train_s = time.perf_counter() - start
                if repeat:
                    results[name]["log_prob_s"].append(log_prob_s)
                    results[name]["train_s"].append(train_s)
                results[name]["padding_share"] = metrics.padding_share
                print(f"  repeat {repeat} {name}: log-probs {log_prob_s:.2f} s, train {train_s:.2f} s", flush=True)
    ordered = sorted(responses)
    workload = {
        "sequences": len(responses),
        "prompt": args.prompt,
        "response_median": statistics.median(ordered),
        "response_max": ordered[-1],
        "tokens": sum(responses) + args.prompt * len(responses),
        "budget": args.budget,
        "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab},
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu": cpu_model(),
    }
    summary = {}
    for name, r in results.items():
        summary[name] = {
            "log_prob_s_median": statistics.median(r["log_prob_s"]),
            "log_prob_s_range": [min(r["log_prob_s"]), max(r["log_prob_s"])],
            "train_s_median": statistics.median(r["train_s"]),
            "train_s_range": [min(r["train_s"]), max(r["train_s"])],
            "padding_share": r["padding_share"],
            "micro_batches": r["micro_batches"],
            "predicted_cpu_train_flops": r["cpu_flops"],
            "predicted_gpu_train_flops": r["gpu_flops"],
        }
    padded, packed = summary["padded rows"], summary["packed"]
    ratios = {
        "log_prob_speedup": padded["log_prob_s_median"] / packed["log_prob_s_median"],
        "train_speedup": padded["train_s_median"] / packed["train_s_median"],
        "predicted_cpu_speedup": padded["predicted_cpu_train_flops"] / packed["predicted_cpu_train_flops"],
        "predicted_gpu_speedup": padded["predicted_gpu_train_flops"] / packed["predicted_gpu_train_flops"],
    }
    return {"workload": workload, "modes": summary, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--min-response", type=int, default=10)
    parser.add_argument("--max-response", type=int, default=1000)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    from dapo_megatron.runtime.launch import launch_local

    out = args.json or Path("/tmp/bench_packing.json")
    launch_local(_rank, 1, (vars(args), str(out)))
    result = json.loads(out.read_text())
    w = result["workload"]
    print(
        f"workload: {w['sequences']} sequences, responses median {w['response_median']} max {w['response_max']} "
        f"tokens, budget {w['budget']}"
    )
    for name, m in result["modes"].items():
        print(
            f"{name:12s} log-probs {m['log_prob_s_median']:.2f} s {m['log_prob_s_range']}, "
            f"train {m['train_s_median']:.2f} s {m['train_s_range']}, padding {m['padding_share']:.1%}, "
            f"{m['micro_batches']} micro-batches"
        )
    print(json.dumps(result["ratios"], indent=1))


def _rank(arguments: dict, out: str) -> None:
    result = measure(argparse.Namespace(**arguments))
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
