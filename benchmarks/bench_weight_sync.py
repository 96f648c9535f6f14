"""Weight sync at four layouts side by side, each against the plain-copy ceiling.

Run: ``.venv/bin/python benchmarks/bench_weight_sync.py [--steps 3] [--json FILE]``.

Runs the ``sync`` phase of ``dapo-megatron bench`` (the trainer's system: Ray, the actor's
ranks, transformers engines in their own processes, weights by shared-memory handle) on
``benchmarks/sync_cpu.yaml`` (a 1.2 GB fp32 Qwen2 shape on two CPU ranks) at tp=1
(data parallel 2), tp=2, two pipeline stages, and tp=1 with two engines fed at once. The
ceiling is a plain copy of the same bytes, measured in each run; with two engines the
bytes delivered are twice the model's.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dapo_megatron.bench.run import BenchOptions, run_bench
from dapo_megatron.config import load_config

CONFIG = Path(__file__).with_name("sync_cpu.yaml")
LAYOUTS = {
    "tp=1, dp=2, 1 engine": [],
    "tp=2, 1 engine": ["parallel.tp_size=2"],
    "pp=2, 1 engine": ["parallel.pp_size=2"],
    "tp=1, dp=2, 2 engines": ["rollout.num_engines=2"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="write every run's result to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = {}
    for name, overrides in LAYOUTS.items():
        config = load_config(str(CONFIG), overrides)
        results[name] = run_bench(config, BenchOptions(phases=("sync",), steps=args.steps))
        sync = results[name]["phases"]["sync"]
        print(
            f"{name:24s} {sync['bytes_into_engines'] / 1e9:.2f} GB in {sync['seconds']['median']:.3f} s "
            f"(spread {sync['seconds']['spread']:.0%}) = {sync['gb_per_s']:.2f} GB/s; copy ceiling "
            f"{results[name]['ceilings']['copy_bytes_per_s'] / 1e9:.2f} GB/s; ratio {sync['of_copy_ceiling']:.2f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
