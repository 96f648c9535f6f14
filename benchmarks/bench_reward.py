"""Throughput of the ``dapo_math`` reward on 20,000-character responses, on one core.

Run: ``.venv/bin/python benchmarks/bench_reward.py [--num 20000] [--chars 20000]``.
Pins itself to one CPU core, builds a mix of responses (correct, wrong, no answer,
boxed, thousands separators, prose and units, end tokens, unevaluated
fractions and roots, hedged boxes, adversarial tails), scores them through the same
:class:`RewardScorer` the trainer uses, and prints responses per second.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from dapo_megatron.algo.rewards import RewardScorer


def make_responses(num: int, chars: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    words = "we compute the sum of the terms and simplify so that the result follows".split()
    endings = [
        lambda a: f"\nAnswer: {a}",
        lambda a: f"\nAnswer: $\\boxed{{{a}}}$",
        lambda a: f"\nAnswer: {a + 1:,}",
        lambda a: f"\nAnswer: {a:,} dollars.",
        lambda a: "\nI could not finish.",
        lambda a: "\nAnswer: 1" + "m" * 250 + "x",
        lambda a: f"\nAnswer:\n\nThe value is ${a}\\,\\text{{cm}}$ (as computed above).<|im_end|>",
        lambda a: f"\nAnswer: $\\frac{{{2 * a}}}{{2}}$</s>",
        lambda a: f"\nAnswer: \\boxed{{{a}}} or \\boxed{{{a + 1}}}",
        lambda a: f"\nAnswer: $\\sqrt{{{a * a}}}$",
    ]
    responses, truths = [], []
    for i in range(num):
        answer = rng.randint(0, 10**6)
        ending = endings[i % len(endings)](answer)
        body = []
        length = 0
        while length < chars - len(ending):
            word = rng.choice(words)
            body.append(word)
            length += len(word) + 1
        responses.append((" ".join(body))[: chars - len(ending)] + ending)
        truths.append(str(answer))
    return responses, truths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=20_000, help="responses to score")
    parser.add_argument("--chars", type=int, default=20_000, help="characters per response")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the best is reported")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    responses, truths = make_responses(args.num, args.chars)
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
