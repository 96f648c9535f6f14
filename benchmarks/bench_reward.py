"""Throughput of the ``dapo_math`` reward on 20,000-character responses, on one core.

Run: ``.venv/bin/python benchmarks/bench_reward.py [--num 20000] [--chars 20000]``.

The ``reward`` phase of ``dapo-megatron bench`` without the rest of the system: the same
mix of responses (:func:`dapo_megatron.bench.workloads.reward_mix`: correct, wrong, no
answer, boxed, thousands separators, prose and units, end tokens, unevaluated fractions
and roots, hedged boxes, adversarial tails), scored by the same :class:`RewardScorer` the
trainer uses, on one pinned core; prints responses per second.
"""

from __future__ import annotations

import argparse
import os
import time

from dapo_megatron.algo.rewards import RewardScorer
from dapo_megatron.bench.workloads import reward_mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=20_000, help="responses to score")
    parser.add_argument("--chars", type=int, default=20_000, help="characters per response")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the best is reported")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    responses, truths = reward_mix(args.num, args.chars)
    scorer = RewardScorer("dapo_math")
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        results, metrics = scorer.score_batch(responses, truths)
        best = min(best, time.perf_counter() - start)
    print(
        f"dapo_math: {args.num} responses of {args.chars} chars in {best:.3f} s on one core = "
        f"{args.num / best:,.0f} responses/s (accuracy of the mix {metrics['accuracy']:.3f}, "
        f"timeouts {metrics['timeouts']:.0f})"
    )


if __name__ == "__main__":
    main()
