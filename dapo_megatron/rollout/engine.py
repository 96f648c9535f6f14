"""The one interface the trainer drives rollout engines through.

SGLang on a GPU and transformers on a CPU (tests and the embedded demo) both implement
:class:`RolloutEngine`, so the trainer never knows which it has. An engine takes prompt
token ids and returns, for every response, its token ids, text, the log-prob of each
sampled token, and why it stopped; it takes new weights as a stream of buckets of
HF-named tensors; and, when colocated with the actor, it can release and resume its
device memory.

The log-prob reported for a token is ``log_softmax(logits / temperature)`` at that token:
the same quantity the actor computes for the same tokens, so their difference (the
train/rollout consistency metric) measures only numerical mismatch between the two.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np

from dapo_megatron.weight_sync.bucket import SyncStats, WeightBucket, WeightSyncError, with_last_flag


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_new_tokens: int = 128
    """Longest response; a response that reaches it finishes with reason ``length``."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a response (kept as its last token); reason ``stop``."""
    stop_strings: tuple[str, ...] = ()
    """Text that ends a response (a multi-turn environment's tool-call tag): the response
    ends with the token that completes it, kept; reason ``stop``. An engine that cannot
    stop on text refuses a request that asks for it."""
    seed: Optional[int] = None
    """Seed of the sampler, for reproducible rollouts (one for the whole request; rows
    derive theirs from it unless ``row_seeds`` is given)."""
    row_seeds: Optional[tuple[int, ...]] = None
    """One seed per response row (prompt-major: the ``n`` rows of prompt 0 first), from
    :func:`~dapo_megatron.rollout.seeds.sampling_seeds`: distinct for every (step, round, prompt, sample) of a run. An
    engine that samples rows with their own seeds (SGLang) uses them; one that seeds a
    whole request (transformers) uses the first."""
    return_routed_experts: bool = False
    """Return the experts a mixture-of-experts model routed every token to
    (``Generation.routed_experts``; ``model.routing_replay``)."""

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"bad sampling parameters: temperature={self.temperature} (>= 0), top_p={self.top_p} "
                f"(in (0, 1]), max_new_tokens={self.max_new_tokens} (>= 1)"
            )


@dataclass
class Generation:
    """One sampled response."""

    prompt_index: int
    """Which prompt of the request it answers."""
    token_ids: list[int]
    """The response's tokens (the stop token included when it stopped on one)."""
    log_probs: list[float]
    """``log_softmax(logits / temperature)`` of each response token when it was sampled."""
    finish_reason: Literal["stop", "length", "abort"]
    """``stop``: ended on a stop token; ``length``: reached ``max_new_tokens``; ``abort``:
    the engine gave up on the request (its group is not trained on)."""
    text: Optional[str] = None
    """Decoded text, when the engine has a tokenizer."""
    weight_version: int = -1
    """The version of the weights the engine held when it sampled this response (the
    actor step they come from, as the last weight sync told the engine; -1: none)."""
    routed_experts: Optional[np.ndarray] = None
    """With ``return_routed_experts``: ``[positions, moe_layers, k]`` expert ids of the
    prompt's and the response's tokens but the last (``rollout/routed_experts.py``)."""


def stop_string_end(decode, tokens: list[int], stop_strings: tuple[str, ...]) -> Optional[int]:
    """How many of ``tokens`` make up a response that stops on text: up to the first
    token whose text (``decode(ids)``) completes one of ``stop_strings``; None when none
    does. A longer prefix holds whatever a shorter one does: found by bisection."""

    def holds(end: int) -> bool:
        text = decode(tokens[:end])
        return any(stop in text for stop in stop_strings)

    if not stop_strings or not tokens or not holds(len(tokens)):
        return None
    low, high = 1, len(tokens)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle + 1, high)
    return low


@dataclass
class StreamRow:
    """One response of a streamed group, as far as it has been generated."""

    seed: int
    """Its sampling seed (from :func:`sampling_seeds`; :func:`continuation_seed` once it
    holds tokens). SGLang samples each row with its own; the transformers engine seeds a
    whole chunk's ``generate`` call with its first running row's."""
    token_ids: list[int] = field(default_factory=list)
    """The tokens sampled so far (the stop token included once it stopped on one)."""
    log_probs: list[float] = field(default_factory=list)
    """The sampling log-prob of each token, under the weights that sampled it."""
    versions: list[int] = field(default_factory=list)
    """The weight version that sampled each token (partial rollouts continue a response
    under newer weights, so one response can hold several)."""
    finish_reason: Optional[str] = None
    """None while it is still generating; then ``stop``, ``length`` or ``abort``."""
    turn_start: int = 0
    """Multi-turn episodes: where the model's current turn begins in ``token_ids`` (after
    the last observation). The request's stop strings are looked for from there on, never
    in what the environment wrote."""
    routed_experts: Optional[np.ndarray] = None
    """With ``return_routed_experts``: the routing record of the prompt and the tokens so
    far (``rollout/routed_experts.py``), each position as routed when it was sampled from."""


@dataclass
class StreamGroup:
    """The ``n`` responses of one prompt, streamed: handed to an engine, advanced chunk by
    chunk, handed back whole once every response has finished (or at an abort, as far as
    it got)."""

    key: int
    """Its identity in the run (the driver's draw counter)."""
    prompt_ids: list[int]
    """The prompt's tokens."""
    rows: list[StreamRow]
    """Its responses."""

    @property
    def done(self) -> bool:
        """Every response has finished."""
        return all(row.finish_reason is not None for row in self.rows)

    @property
    def num_tokens(self) -> int:
        """Response tokens generated so far, all rows."""
        return sum(len(row.token_ids) for row in self.rows)


class RolloutEngine(abc.ABC):
    """Generates responses; receives weights. See the module docstring."""

    accepts_pieces: bool = False
    """Whether :meth:`load_weight_bucket` takes buckets of pieces (``WeightBucket.offsets``),
    so every tensor-parallel rank can send its own shards without a gather."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Generation]:
        """``n`` responses for each prompt, prompt by prompt (``n * len(prompts)`` results)."""

    def update_weights(self, buckets: Iterable[WeightBucket]) -> SyncStats:
        """Replace the model's weights with the streamed tensors, all or nothing.

        Raises :class:`WeightSyncError` (and keeps the previous weights) when the stream
        fails, names an unknown tensor, has a wrong shape or dtype, or leaves tensors out.
        The same session as :meth:`begin_weight_update` / :meth:`load_weight_bucket` /
        :meth:`end_weight_update`, driven from one iterable.
        """
        self.begin_weight_update()
        received = 0

        def counted() -> Iterator[WeightBucket]:
            nonlocal received
            for bucket in buckets:
                received += len(bucket.tensors)
                yield bucket

        try:
            for bucket, last in with_last_flag(counted()):
                self.load_weight_bucket(bucket, last)
        except WeightSyncError:
            self.abort_weight_update()
            raise
        except BaseException as exc:
            self.abort_weight_update()
            if not isinstance(exc, Exception):
                raise
            raise WeightSyncError(
                f"weight stream failed after {received} tensors ({type(exc).__name__}: {exc}); "
                "the engine keeps its previous weights"
            ) from exc
        return self.end_weight_update()

    # A weight update is a session, so that buckets can arrive one call at a time from
    # another process (the orchestration hands each bucket over by handle).

    @abc.abstractmethod
    def begin_weight_update(self) -> None:
        """Open a weight update: buckets follow, then :meth:`end_weight_update`."""

    @abc.abstractmethod
    def load_weight_bucket(self, bucket: WeightBucket, last: bool) -> None:
        """Take one bucket of the open update; the engine copies what it keeps before
        returning (the bucket's memory is reused by the sender afterwards)."""

    @abc.abstractmethod
    def end_weight_update(self) -> SyncStats:
        """Close the update: check that every tensor arrived and start serving them."""

    @abc.abstractmethod
    def abort_weight_update(self) -> None:
        """Drop an open update after a failure (the previous weights keep serving where
        the engine can keep them)."""

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Free device memory (weights and caches) while the actor trains on the same GPUs."""

    @abc.abstractmethod
    def resume_memory(self) -> None:
        """Take device memory back after :meth:`release_memory`."""

    @abc.abstractmethod
    def health(self) -> dict:
        """A small status dict: at least ``ok`` (bool) and ``engine`` (its kind)."""

    # Streamed generation (``rollout.streaming``): groups go in, advance a chunk at a
    # time, and come back as soon as all their responses have finished; an abort hands
    # back every group still in the engine: those still generating as far as they got,
    # and those that finished after the last step (SGLang generates on its own between
    # calls) whole.

    def stream_add(self, groups: list[StreamGroup], params: SamplingParams) -> None:
        """Start (or, for rows that already hold tokens, continue) generating ``groups``."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def stream_step(self, max_tokens: int, version: int) -> list[StreamGroup]:
        """Advance every unfinished response by up to ``max_tokens`` tokens (stamped with
        weight ``version``); the groups that are now complete, removed from the engine."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def stream_abort(self, version: int) -> list[StreamGroup]:
        """Stop everything in flight; every group still in the engine, removed from it:
        the unfinished ones as far as they got (finished rows whole, the others' prefixes)
        and, on an engine that generates between calls (SGLang), any that completed after
        the last :meth:`stream_step`, whole (``done``: the caller scores them as it would
        have from the step). Tokens sampled since the last step are stamped with
        ``version``."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def stream_running(self) -> tuple[int, int]:
        """Rows of the groups in flight still generating, and their context tokens (their
        prompts' and the tokens they hold)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Stop processes the engine started."""
