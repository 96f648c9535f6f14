"""Token grids, micro-batches by token budget, and data-parallel shards."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.actor.batch import PolicyBatch, plan_micro_batches, shard_for_data_parallel


def _batch(prompts, responses):
    width = max(p + r for p, r in zip(prompts, responses))
    return PolicyBatch(
        tokens=torch.arange(len(prompts) * width).reshape(len(prompts), width),
        prompt_lengths=torch.tensor(prompts),
        response_lengths=torch.tensor(responses),
        advantages=torch.arange(len(prompts), dtype=torch.float32),
    )


def test_response_mask_is_on_the_label_grid():
    batch = _batch([2, 1], [3, 1])
    expected = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.float32)
    torch.testing.assert_close(batch.response_mask(), expected)
    batch.loss_mask = torch.zeros(2, 5)
    assert batch.response_mask().sum() == 0


def test_micro_batches_pack_by_token_budget():
    lengths = [30, 4, 25, 5, 6, 28]
    plans = plan_micro_batches(lengths, max_tokens=60)
    # Longest first: [30, 28] (2 x 30 = 60), [25, 6] (2 x 25 = 50 <= 60, a third would be 75), [5, 4].
    assert plans == [[0, 5], [2, 4], [3, 1]]
    assert sorted(i for plan in plans for i in plan) == list(range(6))
    for plan in plans:
        assert len(plan) * max(lengths[i] for i in plan) <= 60
    # Rounding the width up to a multiple (sequence parallelism) is part of the budget.
    assert plan_micro_batches([5, 5, 5], max_tokens=16, pad_multiple=8) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="a sequence of 70 tokens does not fit trainer.micro_batch_max_tokens=60"):
        plan_micro_batches([70], max_tokens=60)


def test_data_parallel_shards_are_equal_in_rows_and_balanced_in_tokens():
    batch = _batch([2] * 8, [40, 1, 30, 2, 20, 3, 10, 4])
    shards = [shard_for_data_parallel(batch, rank, 2, num_mini_batches=2) for rank in range(2)]
    assert [s.num_rows for s in shards] == [4, 4]
    # Mini-batch 0 is rows 0-3, mini-batch 1 rows 4-7; each rank gets 2 of each, in order.
    first_halves = [s.split(2)[0].advantages.tolist() for s in shards]
    assert sorted(first_halves[0] + first_halves[1]) == [0, 1, 2, 3]
    # Each mini-batch is its own optimizer step, so balance counts per mini-batch: sequence
    # lengths 42, 3, 32, 4 split {42, 3} / {32, 4}, the most even split of 2 + 2 rows.
    loads = [[int(part.seq_lengths.sum()) for part in s.split(2)] for s in shards]
    assert loads == [[45, 27], [36, 18]]
    with pytest.raises(ValueError, match="8 rows cannot be split into 3 mini-batches over 2"):
        shard_for_data_parallel(batch, 0, 2, num_mini_batches=3)


def test_batch_validation():
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\)"):
        PolicyBatch(
            tokens=torch.zeros(2, 4, dtype=torch.long),
            prompt_lengths=torch.tensor([1, 1]),
            response_lengths=torch.tensor([1, 1]),
            advantages=torch.zeros(3),
        )
    with pytest.raises(ValueError, match="exceed the token grid's 4 columns"):
        PolicyBatch(
            tokens=torch.zeros(2, 4, dtype=torch.long),
            prompt_lengths=torch.tensor([1, 2]),
            response_lengths=torch.tensor([1, 3]),
        )
    with pytest.raises(ValueError, match="at least one prompt token"):
        PolicyBatch(
            tokens=torch.zeros(1, 4, dtype=torch.long),
            prompt_lengths=torch.tensor([0]),
            response_lengths=torch.tensor([1]),
        )
    with pytest.raises(ValueError, match="cannot split 3 rows into 2 equal mini-batches"):
        _batch([1, 1, 1], [1, 1, 1]).split(2)


@pytest.mark.parametrize(("row", "column"), [(0, 0), (0, 1), (1, 3), (1, 4)])
def test_loss_mask_outside_the_response_is_refused(row, column):
    batch = _batch([2, 1], [3, 1])  # responses: row 0 columns 2..4, row 1 column 1
    mask = batch.response_mask().clone()
    mask[row, column] = 1.0
    with pytest.raises(ValueError, match=f"outside the response at row {row}, column {column}"):
        PolicyBatch(batch.tokens, batch.prompt_lengths, batch.response_lengths, loss_mask=mask)
    # Inside the response any subset is fine (overlong filtering zeroes whole rows).
    inside = batch.response_mask().clone()
    inside[0] = 0
    assert PolicyBatch(batch.tokens, batch.prompt_lengths, batch.response_lengths, loss_mask=inside).num_rows == 2


def test_target_ids_outside_the_vocabulary_are_refused():
    batch = _batch([2, 1], [3, 1])  # tokens 0..9; response tokens 2, 3, 4 and 6
    batch.check_target_ids(7)
    with pytest.raises(ValueError, match=r"token id 6 is a response token but the vocabulary has 6 ids \(0..5\)"):
        batch.check_target_ids(6)
    # Prompt and padding ids do not count.
    batch.tokens[0, 0] = 10_000
    batch.tokens[1, 4] = -5
    batch.check_target_ids(7)


@pytest.mark.parametrize(
    "tp, sequence_parallel, fp8, multiple",
    [(1, False, False, 1), (4, True, False, 4), (1, False, True, 16), (4, True, True, 64), (2, False, True, 32)],
)
def test_fp8_pads_every_micro_batch_to_16_tokens_per_tp_rank(tp, sequence_parallel, fp8, multiple):
    from dapo_megatron.actor.batch import plan_micro_batches
    from dapo_megatron.config.layout import sequence_pad_multiple

    assert sequence_pad_multiple(tp, sequence_parallel, fp8) == multiple
    lengths = [7, 33, 50, 3, 18]
    for rows in plan_micro_batches(lengths, 4096, multiple):
        width = -(-max(lengths[i] for i in rows) // multiple) * multiple
        tokens_per_rank = width * len(rows) // (tp if sequence_parallel or fp8 else 1)
        assert width % multiple == 0 and (not fp8 or tokens_per_rank % 16 == 0)


def test_packed_rows_are_filled_first_fit_by_decreasing_length():
    from dapo_megatron.actor.packing import plan_packed_micro_batches

    lengths = [13, 9, 20, 10, 12, 13, 7, 11]
    rows = plan_packed_micro_batches(lengths, 24)
    # Longest first, each into the first row with room: 20 | 13 + 11 (exactly 24) |
    # 13 + 10 | 12 + 9 | 7 (no row has 7 left).
    assert rows == [[2], [0, 7], [5, 3], [4, 1], [6]]
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 24 for row in rows)
    # The pad multiple applies to the row's total: 13 + 10 = 23 rounds to 24, 13 + 11 too.
    assert plan_packed_micro_batches([13, 10, 11], 24, pad_multiple=4) == [[0, 2], [1]]
    with pytest.raises(ValueError, match="does not fit trainer.micro_batch_max_tokens=24"):
        plan_packed_micro_batches([25], 24)


def test_a_packed_row_attends_within_each_sequence_and_restarts_positions():
    from dapo_megatron.actor.packing import segment_position_ids, segments_of

    segments = segments_of([3, 2], 7)
    assert segments == [3, 2, 2]  # the padding tail is a segment of its own
    assert segment_position_ids(segments).tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert segments_of([4, 3], 7) == [4, 3]  # a row filled exactly: no padding segment
    with pytest.raises(ValueError, match="do not fit a row of 6"):
        segments_of([4, 3], 6)


def test_thd_parameters_carry_the_cumulative_lengths_of_the_segments():
    """The packed path of both specs: megatron's PackedSeqParams in THD format,
    cu_seqlens of every segment (the padding tail included) as int32, for queries and keys."""
    from dapo_megatron.actor.packing import packed_seq_params

    params = packed_seq_params([3, 2, 2], "cpu")
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q.tolist() == [0, 3, 5, 7]
    assert params.cu_seqlens_kv.tolist() == [0, 3, 5, 7] and params.max_seqlen_q == params.max_seqlen_kv == 3
