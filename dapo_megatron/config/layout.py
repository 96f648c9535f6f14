"""The width the actor gives a micro-batch's rows: its tokens rounded up to the pad
multiple (the rest of the layout's arithmetic is :class:`~dapo_megatron.config.sections.ParallelConfig`'s:
the data-parallel, model-parallel and expert-data-parallel sizes, the layers of each
pipeline stage).

Sequence parallelism splits every row's sequence over the tensor-parallel ranks, and
Transformer Engine's fp8 GEMMs need each rank's share to be a multiple of 16 tokens, so
the actor rounds each row up (``actor/batch.py`` for padded rows, ``actor/packing.py``
for packed ones). Config validation must round the same way to tell, before a whole
generation, whether one full sequence fits ``trainer.micro_batch_max_tokens``: both use
these functions. Pure arithmetic, no torch (the config layer imports it).
"""

from __future__ import annotations

FP8_TOKEN_MULTIPLE = 16
"""Transformer Engine's fp8 GEMMs need the token count divisible by 8; 16 is what its
own padding helpers use."""


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def sequence_pad_multiple(tp_size: int, sequence_parallel: bool, fp8: bool) -> int:
    """What every micro-batch's width is rounded up to: the tensor-parallel size with
    sequence parallelism (the sequence is split over the TP ranks); with fp8,
    ``16 x tp`` so that each rank's share of every row is a multiple of 16 tokens."""
    if fp8:
        return FP8_TOKEN_MULTIPLE * tp_size
    return tp_size if sequence_parallel else 1
