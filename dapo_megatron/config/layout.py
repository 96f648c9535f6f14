"""The parallel layout's arithmetic, shared by validation, ``plan`` and the actor: the
data-parallel size, the layers on each pipeline stage, and the width the actor gives a
micro-batch's rows (its tokens rounded up to the pad multiple).

Sequence parallelism splits every row's sequence over the tensor-parallel ranks, and
Transformer Engine's fp8 GEMMs need each rank's share to be a multiple of 16 tokens, so
the actor rounds each row up (``actor/batch.py`` for padded rows, ``actor/packing.py``
for packed ones). Config validation must round the same way to tell, before a whole
generation, whether one full sequence fits ``trainer.micro_batch_max_tokens``: both use
these functions. Pure arithmetic, no torch (the config layer imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapo_megatron.config.sections import ParallelConfig

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


def pipeline_layer_split(num_layers: int, parallel: ParallelConfig) -> list[int]:
    """Layers on each pipeline stage, or raise ValueError saying why the split is impossible."""
    pp = parallel.pp_size
    first = parallel.num_layers_in_first_pipeline_stage
    last = parallel.num_layers_in_last_pipeline_stage
    if pp == 1:
        return [num_layers]
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        raise ValueError("uneven split does not add up")
    if middle_stages and middle_layers % middle_stages:
        raise ValueError("uneven split does not add up")
    per_stage = middle_layers // middle_stages if middle_stages else 0
    split = [per_stage] * pp
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return split
