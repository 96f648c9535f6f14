"""Generation in rounds vs streamed, side by side on a long-tail workload, in one run.

Run: ``.venv/bin/python benchmarks/bench_streaming.py [--steps 4] [--json FILE] [--plot FILE]``.

The workload (built once into ``--work``): the demo's tokenizer and addition prompts,
and a tiny Qwen2 (2 layers, hidden 64) fine-tuned for a few seconds to answer each
prompt with a run of digits whose length is drawn log-uniformly from 1 to
``MAX_RESPONSE`` tokens, then stop. Sampling it reproduces DAPO's long tail: most
responses are short, a few run ten times the median or more (the script prints the
measured median, 90th percentile and maximum). The reward is right for even answers
when the response has an even number of characters, wrong for odd answers: about half
the groups are dropped by dynamic sampling, as in DAPO's early steps.

On one running system (Ray, one actor rank, two transformers engines, the reward pool)
the same batch composition (``train_batch_size`` groups of ``n``) is trained in four
modes, one after the other, each from the same prompt order: rounds (today's default),
streaming, streaming + carry-over, and streaming + carry-over + partial rollouts. The
learning rate is 1e-9, so every mode samples from the same policy. Each mode runs one
unmeasured step, then ``--steps`` measured ones; reported per mode: the median step time
and its range, the generation phase, generated response tokens per trained one, and the
engines' idle share of the generation phase (streaming modes: each engine's seconds
without work, from its own clock). ``--plot`` draws the generation timeline of one
measured step of the last mode per engine (busy, idle, abort).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dapo_megatron.algo.rewards.base import register_reward  # noqa: E402

MAX_RESPONSE = 256
"""The longest response (rollout.max_response_length)."""
MIN_LENGTH = 1

MODES = {
    "rounds": {},
    "streaming": {"streaming": True},
    "streaming + carry-over": {"streaming": True, "carry_over": True},
    "streaming + carry-over + partial": {"streaming": True, "carry_over": True, "partial_rollout": True},
}


def reward(response: str, ground_truth: str) -> float:
    """Odd answers: wrong; even answers: right when the response has an even length.
    Registered as bounded (it is), so that it runs in-process as ``dapo_math`` does."""
    if int(ground_truth) % 2:
        return -1.0
    return 1.0 if len(response) % 2 == 0 else -1.0


REWARD = "bench_long_tail_parity"
register_reward(REWARD, bounded=True)(reward)


def build_workload(work: Path) -> Path:
    """The tokenizer, the prompts and the long-tail model in ``work`` (built once)."""
    if (work / "model" / "model.safetensors").exists():
        return work
    import importlib.util

    from transformers import AutoModelForCausalLM, Qwen2Config

    from dapo_megatron.data.prompts import render_prompt

    spec = importlib.util.spec_from_file_location("demo_prepare", REPO / "examples/demo/prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    tokenizer = prepare.build_tokenizer(work / "model")
    prepare.write_task(work / "data")
    config = Qwen2Config(
        vocab_size=len(prepare.VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    prompts = [json.loads(line) for line in (work / "data/train.jsonl").read_text().splitlines()]
    prompt_ids = [tokenizer.encode(render_prompt(tokenizer, p["prompt"])) for p in prompts]
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    rng = random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(800):  # responses of log-uniform length: the hazard of stopping falls as 1/t
        rows, masks = [], []
        for _ in range(32):
            ids = list(rng.choice(prompt_ids))
            length = int(math.exp(rng.uniform(math.log(MIN_LENGTH), math.log(MAX_RESPONSE - 1))))
            response = [rng.choice(digits) for _ in range(length)] + [tokenizer.eos_token_id]
            rows.append(ids + response)
            masks.append([0] * len(ids) + [1] * len(response))
        width = max(len(r) for r in rows)
        tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        logits = model(tokens).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        loss = (loss * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(work / "model")
    return work


def run_config(work: Path, out: Path, steps: int) -> dict:
    return {
        "model": {"hf_config": str(work / "model"), "hf_weights": str(work / "model")},
        "parallel": {"device": "cpu", "num_devices_per_node": 1, "tp_size": 1},
        "rollout": {
            "engine": "hf",
            "num_engines": 2,
            "n_samples_per_prompt": 4,
            "temperature": 1.0,
            "max_prompt_length": 16,
            "max_response_length": MAX_RESPONSE,
        },
        "algorithm": {
            "overlong_buffer_enable": False,
            "max_num_gen_batches": 0,
            "reward_fn": REWARD,
        },
        "data": {
            "train_files": [str(work / "data/train.jsonl")],
            "train_batch_size": 8,
            "gen_batch_size": 8,
            "mini_batch_size": 32,
        },
        "trainer": {
            "num_steps": steps,
            "lr": 1e-9,
            "lr_warmup_steps": 0,
            "micro_batch_max_tokens": 4096,
            "output_dir": str(out),
            "val_before_train": False,
        },
        "checkpoint": {"save_every": 0, "export_hf": False},
    }


def length_profile(work: Path) -> dict:
    """Median, 90th percentile and maximum of 256 sampled responses' lengths."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_megatron.data.prompts import render_prompt

    model = AutoModelForCausalLM.from_pretrained(str(work / "model")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(work / "model"))
    prompts = [json.loads(line)["prompt"] for line in (work / "data/train.jsonl").read_text().splitlines()][:64]
    ids = [tokenizer.encode(render_prompt(tokenizer, p)) for p in prompts]
    width = max(len(i) for i in ids)
    batch = torch.tensor([[0] * (width - len(i)) + i for i in ids])
    attention = (torch.arange(width)[None] >= torch.tensor([width - len(i) for i in ids])[:, None]).long()
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=batch.repeat_interleave(4, 0),
            attention_mask=attention.repeat_interleave(4, 0),
            do_sample=True,
            top_k=0,
            max_new_tokens=MAX_RESPONSE,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=0,
        )
    lengths = sorted(
        (row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else MAX_RESPONSE)
        for row in out[:, width:].tolist()
    )
    return {
        "median": statistics.median(lengths),
        "p90": lengths[int(0.9 * len(lengths))],
        "max": lengths[-1],
        "samples": len(lengths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="measured steps per mode (after one unmeasured)")
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dapo_long_tail"))
    parser.add_argument("--chunk", type=int, default=32, help="rollout.stream_chunk_tokens")
    parser.add_argument("--in-flight", type=int, default=0, help="rollout.max_prompts_in_flight (0: gen_batch_size)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--plot", help="draw one streamed step's generation timeline into this PNG")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from dapo_megatron.config import config_from_dict
    from dapo_megatron.data import PromptLoader
    from dapo_megatron.run.step import StepRunner
    from dapo_megatron.run.system import load_initial_weights, load_run_data, start_system
    from dapo_megatron.sampling.rounds import training_sampling

    work = build_workload(Path(args.work))
    profile = length_profile(work)
    print(
        f"response lengths of {profile['samples']} samples: median {profile['median']}, p90 {profile['p90']}, "
        f"max {profile['max']} (max / median {profile['max'] / profile['median']:.1f})",
        flush=True,
    )
    steps = args.steps + 1
    total = steps * len(MODES)
    base = config_from_dict(run_config(work, work / "run", total), "bench_streaming")
    results: dict = {"length_profile": profile, "modes": {}}
    timeline = None
    with ExitStack() as stack:
        run_dir = work / "run"
        run_dir.mkdir(exist_ok=True)
        system = start_system(base, run_dir, stack)
        load_initial_weights(system.actor, base)
        tokenizer, train_data, _, _ = load_run_data(base)
        sampling = training_sampling(base.rollout, tokenizer)
        system.sync_engines(0)
        version = 0
        for name, switches in MODES.items():
            raw = run_config(work, run_dir, total)
            raw["rollout"].update(switches)
            if switches:  # the streaming keys are refused without streaming
                raw["rollout"].update(stream_chunk_tokens=args.chunk, max_prompts_in_flight=args.in_flight)
            config = config_from_dict(raw, name)
            loader = PromptLoader(train_data, seed=config.data.seed, shuffle=config.data.shuffle)
            stepper = StepRunner(system, loader, sampling, tokenizer, version=version, config=config)
            rows = []
            for index in range(steps):
                start = time.perf_counter()
                metrics = stepper.step(version + 1, generate_ahead=False)
                wall = time.perf_counter() - start
                version += 1
                if index == 0:
                    continue
                generated = metrics.get("stream/generated_tokens")
                if generated is None:
                    generated = metrics["throughput/generate_tokens_per_s"] * metrics["time/generate"]
                trained = metrics["actor/tokens"]
                rows.append(
                    {
                        "step_s": wall,
                        "generate_s": metrics.get(
                            "time/generation_phase", metrics["time/generate"] + metrics["time/reward"]
                        ),
                        "generated_tokens": generated,
                        "trained_tokens": trained,
                        "idle_share": metrics.get("time/engine_idle_share_max"),
                        "aborted_tokens": metrics.get("stream/aborted_tokens", 0.0),
                        "length_max": metrics["response/length_max"],
                    }
                )
                if stepper.stream is not None:
                    timeline = stepper.stream.timeline
            results["modes"][name] = _summary(rows)
            s = results["modes"][name]
            idle = f"; engines idle {s['idle_share']:.0%} of generation (max over engines)" if s["idle_share"] else ""
            print(
                f"{name:34s} step {s['step_s']:.2f} s ({s['step_s_min']:.2f}-{s['step_s_max']:.2f}), generation "
                f"{s['generate_s']:.2f} s, generated / trained tokens {s['generated_per_trained']:.2f}{idle}",
                flush=True,
            )
    rounds = results["modes"]["rounds"]["step_s"]
    for summary in results["modes"].values():
        summary["speedup_vs_rounds"] = rounds / summary["step_s"]
    print(
        "speed-up of the median step over rounds: "
        + ", ".join(f"{name} {summary['speedup_vs_rounds']:.2f}x" for name, summary in results["modes"].items())
    )
    results["timeline"] = timeline
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot and timeline:
        plot_timeline(timeline, args.plot)


def _summary(rows: list[dict]) -> dict:
    idle = [r["idle_share"] for r in rows if r["idle_share"] is not None]
    return {
        "step_s": statistics.median(r["step_s"] for r in rows),
        "step_s_min": min(r["step_s"] for r in rows),
        "step_s_max": max(r["step_s"] for r in rows),
        "generate_s": statistics.median(r["generate_s"] for r in rows),
        "generated_per_trained": sum(r["generated_tokens"] for r in rows) / sum(r["trained_tokens"] for r in rows),
        "idle_share": statistics.median(idle) if idle else None,
        "aborted_tokens": sum(r["aborted_tokens"] for r in rows),
        "steps": rows,
    }


def plot_timeline(timeline: list[dict], path: str) -> None:
    """Per engine, each tick's busy (engine's own clock) and idle seconds; the abort in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = len(timeline[0]["busy"])
    end = timeline[-1]["start"] + timeline[-1]["wall"]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * engines))
    for engine in range(engines):  # idle unless drawn over: between ticks the driver scores and feeds
        ax.broken_barh([(0, end)], (engine - 0.35, 0.7), color="0.85")
    for tick in timeline:
        for engine, busy in enumerate(tick["busy"]):
            color = "tab:red" if tick.get("abort") else "tab:green"
            ax.broken_barh([(tick["start"], busy)], (engine - 0.35, 0.7), color=color)
    ax.set_yticks(range(engines), [f"engine {e}" for e in range(engines)])
    ax.set_xlabel("seconds into the generation phase")
    ax.set_title("one streamed step (green: generating, grey: waiting for the driver or the other engine, red: abort)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
