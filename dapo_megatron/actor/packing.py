"""Packed sequences: several sequences back to back in one row, each attending only to itself.

DAPO's response lengths are long-tailed: a micro-batch of padded rows (each sequence its
own row, padded to the longest) is mostly padding, and every padded token costs the
linear layers as much as a real one. Packed, a micro-batch is a single row of at most
``trainer.micro_batch_max_tokens`` tokens holding whole sequences (prompt + response)
placed first-fit by decreasing length; the row's width is its tokens rounded up to the
sequence pad multiple, and that tail of padding is one more segment of its own.

Inside a row nothing may cross a sequence boundary, and positions restart at 0 for
every segment, so that each sequence sees what it sees alone in a row. (RoPE is
relative: inside its own segment a sequence would attend the same in exact arithmetic
at any offset. The restart makes it the same in floating point too: each token gets the
very angles it has alone, not those of a far position, whose cos/sin carry less
precision. The equality tests check both: packed = padded rows, and the float64 reference.)

- Both specs take the row in megatron's THD format: :func:`packed_seq_params` gives the
  ``cu_seqlens`` of its segments, megatron applies RoPE per segment (each from position
  0), and the attention runs per segment: Transformer Engine's on a GPU, and on the
  local spec (the CPU) megatron's own ``DotProductAttention`` called on each segment
  (``models/gpt.py``: ``segment_attention_class``). No ``width x width`` square is ever
  built: attention's work and memory grow with the sum of the segments' squares, as
  with padded rows, while the linear layers skip the padding.

The loss side never sees the packed row: log-probs are computed at the loss tokens of
the row and scattered into the micro-batch's per-sequence grid (one sequence per row), in
the same order, so the DAPO loss, its global token count and the result grids are
unchanged.
"""

from __future__ import annotations

import torch

from dapo_megatron.config.layout import round_up


def plan_packed_micro_batches(seq_lengths: list[int], max_tokens: int, pad_multiple: int = 1) -> list[list[int]]:
    """Sequence indices of each packed row (one row per micro-batch), in row order.

    First-fit decreasing: sequences are taken longest first (ties keep the original
    order) and each goes into the first row that still holds it, the row's total rounded
    up to ``pad_multiple`` staying within ``max_tokens``; a sequence that fits no row opens
    a new one. Deterministic.
    """
    order = sorted(range(len(seq_lengths)), key=lambda i: (-seq_lengths[i], i))
    rows: list[list[int]] = []
    used: list[int] = []
    for index in order:
        length = seq_lengths[index]
        if round_up(length, pad_multiple) > max_tokens:
            raise ValueError(f"a sequence of {length} tokens does not fit trainer.micro_batch_max_tokens={max_tokens}")
        for row, total in enumerate(used):
            if round_up(total + length, pad_multiple) <= max_tokens:
                rows[row].append(index)
                used[row] += length
                break
        else:
            rows.append([index])
            used.append(length)
    return rows


def segments_of(lengths: list[int], width: int) -> list[int]:
    """The segments of a row of ``width`` holding sequences of ``lengths``: the sequences,
    then the padding tail as a segment of its own (when there is one)."""
    total = sum(lengths)
    if total > width:
        raise ValueError(f"sequences of {total} tokens do not fit a row of {width}")
    return list(lengths) + ([width - total] if total < width else [])


def segment_position_ids(segments: list[int]) -> torch.Tensor:
    """``[width]`` position ids that restart at 0 at every segment."""
    return torch.cat([torch.arange(length) for length in segments])


def packed_seq_params(segments: list[int], device: torch.device | str):
    """megatron's ``PackedSeqParams`` for a THD row of ``segments`` (either spec):
    cumulative sequence lengths, the same for queries and keys (self-attention)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = max(segments)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
