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
precision. The mask is what the equality tests check; the angles are checked directly.)

- Megatron's local spec (the CPU): the attention mask argument carries a block-diagonal
  causal mask (:func:`block_causal_mask`, True = masked; megatron's softmax uses it
  instead of its own causal mask). Megatron's RoPE for this layout applies the angle of
  a token's column, not of its position id, so :func:`rope_at_position_ids` makes it take
  the angles at the position ids instead: the same angles a sequence has alone in a row.
  Each row still computes its full ``width x width`` attention square (the mask zeroes
  the cross-sequence part); what packing saves on the CPU is the linear layers' padding.
- Transformer Engine (a GPU): the THD format, megatron's own path for packed sequences:
  :func:`packed_seq_params` gives ``cu_seqlens`` of the segments; megatron applies RoPE
  per sequence and TE's attention computes only the blocks on the diagonal.

The loss side never sees the packed row: log-probs are computed at the loss tokens of
the row and scattered into the micro-batch's per-sequence grid (one sequence per row), in
the same order, so the DAPO loss, its global token count and the result grids are
unchanged.
"""

from __future__ import annotations

import torch

from dapo_megatron.sequence_pad import round_up


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


def block_causal_mask(segments: list[int]) -> torch.Tensor:
    """``[1, 1, width, width]`` boolean attention mask, True where attention is *not*
    allowed: a token attends to itself and the earlier tokens of its own segment only."""
    owner = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments))
    column = torch.arange(owner.numel())
    allowed = (owner[:, None] == owner[None, :]) & (column[:, None] >= column[None, :])
    return (~allowed)[None, None]


def packed_seq_params(segments: list[int], device: torch.device | str):
    """megatron's ``PackedSeqParams`` for a THD row of ``segments`` (Transformer Engine):
    cumulative sequence lengths, the same for queries and keys (self-attention)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = max(segments)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def rope_at_position_ids(gpt) -> None:
    """Make ``gpt``'s rotary embedding take its angles at the position ids given to
    :func:`set_rope_positions` (``[b, s]``) instead of at each token's column.

    megatron's ``RotaryEmbedding`` returns ``[s, 1, 1, dim]`` angles for columns
    ``0..s-1``, and its BSHD/SBHD application broadcasts them over the batch. Gathered at
    the position ids, they become ``[s, b, 1, dim]``, which the same application
    broadcasts over the heads: each token gets the angle of its position, computed by
    megatron's own code for that position. With no position ids set the embedding is
    megatron's, unchanged. Idempotent.
    """
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if rotary is None or hasattr(rotary, "packed_position_ids"):
        return
    by_column = rotary.forward
    rotary.packed_position_ids = None

    def forward(max_seq_len, *args, **kwargs):
        angles = by_column(max_seq_len, *args, **kwargs)
        positions = rotary.packed_position_ids
        if positions is None:
            return angles
        return angles[:, 0, 0][positions.t()].unsqueeze(2)

    rotary.forward = forward


def set_rope_positions(gpt, position_ids: torch.Tensor | None) -> None:
    """The position ids (``[b, s]``) the next forward of ``gpt`` takes RoPE angles at;
    None: by column, megatron's default."""
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if rotary is not None and hasattr(rotary, "packed_position_ids"):
        rotary.packed_position_ids = position_ids
