"""The actor's view of a batch: token grids, micro-batches by token budget, DP shards.

Sequences (prompt + response) of very different lengths are the normal case in RL: DAPO
responses run from a few tokens to 20k. The actor therefore never pads a whole batch to
its longest sequence. Sequences are sorted by length and packed greedily into
micro-batches whose padded size (rows x longest row) stays within a token budget, so
long responses travel alone or in pairs and short ones in large groups. Data-parallel
ranks receive equal numbers of sequences per mini-batch, balanced by tokens.

Per-token tensors live on the *label grid* ``[batch, seq]``: entry ``t`` belongs to the
token ``tokens[t]``, predicted from ``tokens[:t]``. Response tokens of row ``i`` are the
positions ``prompt_lengths[i] <= t < prompt_lengths[i] + response_lengths[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from dapo_megatron.config.layout import round_up


@dataclass
class PolicyBatch:
    """Sequences on the label grid, with what the DAPO loss needs per token and per row."""

    tokens: torch.Tensor
    """``[batch, seq]`` token ids, prompt then response, right-padded (any id)."""
    prompt_lengths: torch.Tensor
    """``[batch]`` prompt tokens of each row (at least 1)."""
    response_lengths: torch.Tensor
    """``[batch]`` response tokens of each row."""
    advantages: Optional[torch.Tensor] = None
    """``[batch]`` advantage of each response (training only)."""
    old_log_probs: Optional[torch.Tensor] = None
    """``[batch, seq]`` log-probs of the tokens under the sampling policy (training only)."""
    loss_mask: Optional[torch.Tensor] = None
    """``[batch, seq]`` tokens that count in the loss; default: all response tokens. Use it
    for overlong filtering (a row of zeros drops a truncated response)."""
    token_weights: Optional[torch.Tensor] = None
    """``[batch, seq]`` constant weights of the tokens' losses (the rollout correction's;
    a 0 removes a token's contribution without changing the token-mean's denominator);
    default: 1."""
    ref_log_probs: Optional[torch.Tensor] = None
    """``[batch, seq]`` log-probs under the reference policy (the KL penalty's), or None."""
    routed_experts: Optional[torch.Tensor] = None
    """``[batch, seq, moe_layers, k]`` the experts the engine routed each input token to
    (``rollout/routed_experts.py``; rollout routing replay), or None."""
    routed_lengths: Optional[torch.Tensor] = None
    """``[batch]`` how many positions of each row ``routed_experts`` covers (from the
    first; the rest, such as the last token, which the engine never fed, are not replayed)."""

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(self.tokens.shape)}")
        batch, seq = self.tokens.shape
        for name in ("prompt_lengths", "response_lengths", "advantages"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (batch,):
                raise ValueError(
                    f"{name} must have shape ({batch},) to match tokens {tuple(self.tokens.shape)}, got {tuple(value.shape)}"
                )
        for name in ("old_log_probs", "loss_mask", "token_weights", "ref_log_probs"):
            value = getattr(self, name)
            if value is not None and value.shape != self.tokens.shape:
                raise ValueError(
                    f"{name} must have shape {tuple(self.tokens.shape)} like tokens, got {tuple(value.shape)}"
                )
        if (self.routed_experts is None) != (self.routed_lengths is None):
            raise ValueError("routed_experts and routed_lengths come together")
        if self.routed_experts is not None and (
            tuple(self.routed_experts.shape[:2]) != (batch, seq) or self.routed_experts.dim() != 4
        ):
            raise ValueError(
                f"routed_experts must be [batch, seq, moe_layers, k] with [batch, seq] = {(batch, seq)}, got "
                f"{tuple(self.routed_experts.shape)}"
            )
        if batch and int(self.prompt_lengths.min()) < 1:
            raise ValueError("every row needs at least one prompt token (the first token is never predicted)")
        if batch and int((self.prompt_lengths + self.response_lengths).max()) > seq:
            raise ValueError(f"prompt + response lengths exceed the token grid's {seq} columns")
        if self.loss_mask is not None and batch:
            # A one outside the response would silently change the token mean's denominator.
            outside = (self.loss_mask != 0) & (self._response_region() == 0)
            if bool(outside.any()):
                row, column = (int(i) for i in outside.nonzero()[0])
                raise ValueError(
                    f"loss_mask is nonzero outside the response at row {row}, column {column} (the response of that "
                    f"row spans columns {int(self.prompt_lengths[row])}.."
                    f"{int(self.prompt_lengths[row] + self.response_lengths[row]) - 1}); only response tokens can "
                    "count in the loss"
                )

    def _response_region(self) -> torch.Tensor:
        positions = torch.arange(self.tokens.shape[1]).unsqueeze(0)
        start = self.prompt_lengths.unsqueeze(1)
        return ((positions >= start) & (positions < start + self.response_lengths.unsqueeze(1))).float()

    def invalid_target_ids(self, vocab_size: int) -> torch.Tensor:
        """The loss tokens' ids outside ``[0, vocab_size)``, in row order."""
        targets = self.tokens[self.response_mask().bool()]
        return targets[(targets < 0) | (targets >= vocab_size)]

    def check_target_ids(self, vocab_size: int) -> None:
        """Refuse a loss token whose id is outside ``[0, vocab_size)``: it would get a
        finite log-prob from a padded (or nonexistent) vocabulary row."""
        bad = self.invalid_target_ids(vocab_size)
        if bad.numel():
            raise ValueError(
                f"token id {int(bad[0])} is a response token but the vocabulary has {vocab_size} ids "
                f"(0..{vocab_size - 1}); {bad.numel()} such token(s) in the batch"
            )

    @property
    def num_rows(self) -> int:
        """Number of sequences."""
        return self.tokens.shape[0]

    @property
    def seq_lengths(self) -> torch.Tensor:
        """``[batch]`` prompt + response tokens."""
        return self.prompt_lengths + self.response_lengths

    def response_mask(self) -> torch.Tensor:
        """``[batch, seq]`` float mask of the tokens that count in the loss."""
        if self.loss_mask is not None:
            return self.loss_mask.float()
        return self._response_region()

    def select(self, rows: torch.Tensor | list[int]) -> PolicyBatch:
        """The rows ``rows``, in that order."""
        index = torch.as_tensor(rows, dtype=torch.long)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return PolicyBatch(**{k: (v[index] if v is not None else None) for k, v in values.items()})

    def trimmed(self) -> PolicyBatch:
        """The same batch with the grid cut to its longest sequence."""
        longest = int(self.seq_lengths.max()) if self.num_rows else 0
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v[:, :longest] for k, v in values.items() if v is not None and v.dim() >= 2})

    def split(self, num_parts: int) -> list[PolicyBatch]:
        """``num_parts`` consecutive equal parts (the mini-batches of a rollout batch)."""
        if num_parts < 1 or self.num_rows % num_parts:
            raise ValueError(f"cannot split {self.num_rows} rows into {num_parts} equal mini-batches")
        size = self.num_rows // num_parts
        return [self.select(list(range(i * size, (i + 1) * size))) for i in range(num_parts)]


def plan_micro_batches(seq_lengths: list[int], max_tokens: int, pad_multiple: int = 1) -> list[list[int]]:
    """Group row indices into micro-batches whose padded size fits ``max_tokens``.

    Rows are taken longest first; a micro-batch grows while ``rows * padded_longest``
    stays within the budget, where the longest row is rounded up to ``pad_multiple``.
    Deterministic: ties keep the original order.
    """
    order = sorted(range(len(seq_lengths)), key=lambda i: (-seq_lengths[i], i))
    plans: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        length = round_up(seq_lengths[index], pad_multiple)
        if length > max_tokens:
            raise ValueError(
                f"a sequence of {seq_lengths[index]} tokens does not fit trainer.micro_batch_max_tokens={max_tokens}"
            )
        width = max(longest, length)
        if current and (len(current) + 1) * width > max_tokens:
            plans.append(current)
            current, width = [], length
        current.append(index)
        longest = width
    if current:
        plans.append(current)
    return plans


def data_parallel_rows(batch: PolicyBatch, dp_rank: int, dp_size: int, num_mini_batches: int = 1) -> list[int]:
    """This data-parallel rank's rows of a rollout batch, mini-batch by mini-batch.

    Every global mini-batch (consecutive rows) is divided into ``dp_size`` equal parts
    balanced by tokens (longest rows first, each to the least-loaded rank with room); the
    rank's parts are concatenated in mini-batch order, so splitting the selected rows into
    ``num_mini_batches`` equal parts gives this rank's share of each global mini-batch.
    """
    if batch.num_rows % (num_mini_batches * dp_size):
        raise ValueError(
            f"{batch.num_rows} rows cannot be split into {num_mini_batches} mini-batches over {dp_size} data-parallel ranks"
        )
    mine: list[int] = []
    per_mini = batch.num_rows // num_mini_batches
    per_rank = per_mini // dp_size
    lengths = batch.seq_lengths.tolist()
    for m in range(num_mini_batches):
        rows = range(m * per_mini, (m + 1) * per_mini)
        load = [0] * dp_size
        assigned: list[list[int]] = [[] for _ in range(dp_size)]
        for row in sorted(rows, key=lambda r: (-lengths[r], r)):
            rank = min((r for r in range(dp_size) if len(assigned[r]) < per_rank), key=lambda r: (load[r], r))
            assigned[rank].append(row)
            load[rank] += lengths[row]
        mine.extend(sorted(assigned[dp_rank]))
    return mine


def shard_for_data_parallel(batch: PolicyBatch, dp_rank: int, dp_size: int, num_mini_batches: int = 1) -> PolicyBatch:
    """The rows :func:`data_parallel_rows` gives this rank, as a batch."""
    return batch.select(data_parallel_rows(batch, dp_rank, dp_size, num_mini_batches))
