"""The reward phase's workload: a reproducible mix of long responses.

DAPO-Math responses run to 20k tokens and the reward must not become the step's
bottleneck, so the reward is measured on long responses with every kind of ending the
scorer must handle (correct, wrong, no answer, boxed, thousands separators, prose and
units, end tokens, unevaluated fractions and roots, hedged boxes, adversarial tails).
"""

from __future__ import annotations

import random


def reward_mix(num: int, chars: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``num`` responses of about ``chars`` characters and their ground truths."""
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
