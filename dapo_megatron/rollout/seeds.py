"""The seed arithmetic of sampling: every response row of a run samples from a seed of
its own, a bijection of (step, round, prompt, sample) mixed with the run's seed, so two
runs of one config sample the same responses and no two rows share a seed.

Its own module, below the engines: the driver derives each round's seeds
(:func:`sampling_seeds`, :func:`prompt_sampling_seeds`) and the engines derive a
streamed row's continuation seed (:func:`continuation_seed`) from the same arithmetic.
"""

from __future__ import annotations

SEED_FIELD_BITS = {"step": 24, "round": 10, "prompt": 17, "sample": 12}
"""Bits of each field of a row's sampling seed (63 in all: SGLang takes int64 seeds)."""


_MASK63 = (1 << 63) - 1


def sampling_seeds(seed: int, step: int, round_index: int, num_prompts: int, n: int) -> tuple[int, ...]:
    """One sampling seed per response row (prompt-major) of a generation request:
    (``step``, ``round_index``, prompt index, sample index) packed into 63 bits, then
    mixed with the run's ``seed`` by a bijection of 63-bit integers (adding a constant,
    xor-shifts, multiplying by odd numbers). Within a run no two rows of any step or
    round share a seed, by construction (the old ``seed + row`` / ``+ engine`` /
    ``+ 1009 * round`` scheme made them overlap); ValueError when a field exceeds its bits."""
    base, offset = _seed_base(seed, step, round_index, num_prompts - 1, n)
    return tuple(row_seed for prompt in range(num_prompts) for row_seed in _prompt_seeds(base, offset, prompt, n))


def prompt_sampling_seeds(seed: int, step: int, round_index: int, prompt: int, n: int) -> tuple[int, ...]:
    """The ``n`` seeds of prompt ``prompt`` alone, the same as :func:`sampling_seeds`'s
    rows ``prompt * n`` to ``(prompt + 1) * n`` of a request of any number of prompts
    beyond it, computed in O(n) (a streamed draw is one prompt of a round)."""
    base, offset = _seed_base(seed, step, round_index, prompt, n)
    return _prompt_seeds(base, offset, prompt, n)


def _seed_base(seed: int, step: int, round_index: int, last_prompt: int, n: int) -> tuple[int, int]:
    """The packed (step, round) bits and the run seed's offset, after checking every field
    (prompt indices up to ``last_prompt``) fits its bits."""
    fields = {"step": step, "round": round_index, "prompt": last_prompt, "sample": n - 1}
    for name, value in fields.items():
        if not 0 <= value < 1 << SEED_FIELD_BITS[name]:
            raise ValueError(
                f"sampling seeds: {name} {value} is outside 0..{(1 << SEED_FIELD_BITS[name]) - 1} (a run's seeds "
                "pack step, round, prompt and sample into 63 bits); use fewer steps, generation rounds, prompts per "
                "round or samples per prompt"
            )
    base = ((step << SEED_FIELD_BITS["round"]) | round_index) << (SEED_FIELD_BITS["prompt"] + SEED_FIELD_BITS["sample"])
    return base, (seed * 0x9E3779B97F4A7C15) & _MASK63


def _prompt_seeds(base: int, offset: int, prompt: int, n: int) -> tuple[int, ...]:
    row = base | (prompt << SEED_FIELD_BITS["sample"])
    return tuple(_mix63((row | sample) + offset) for sample in range(n))


def continuation_seed(seed: int, length: int) -> int:
    """The sampling seed of a streamed row with seed ``seed`` once it holds ``length``
    tokens (``seed`` itself while it holds none): a continuation, after an abort or a
    chunk, samples from a seed of its own, set by the row's seed and its token count."""
    return seed if length == 0 else _mix63(seed ^ (length * 0x9E3779B97F4A7C15))


def _mix63(x: int) -> int:
    """A bijection of 63-bit integers (splitmix64's finaliser, reduced mod 2**63)."""
    x &= _MASK63
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK63
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK63
    return x ^ (x >> 31)
