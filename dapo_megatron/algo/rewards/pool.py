"""Score a whole round of responses in parallel, off the driver's critical path.

The trainer scores hundreds to thousands of responses per generation round. Scoring them
one after another on the driver leaves the other cores idle; a pool of worker
processes, each with its own time-bounded :class:`RewardScorer`, scores contiguous
chunks at once. Results keep the input order. A pool of size 1 (or a round smaller than
``min_parallel``) scores in the calling process, where spawning would cost more than it
saves.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from dapo_megatron.algo.rewards.base import RewardResult
from dapo_megatron.algo.rewards.registry import DEFAULT_WORKER_MEMORY_MB, RewardScorer

_WORKER_SCORER: RewardScorer | None = None


def _init_worker(name: str, timeout_s: float, error_score: float, memory_mb: int) -> None:
    global _WORKER_SCORER
    _WORKER_SCORER = RewardScorer(name, timeout_s, error_score, memory_mb)


def _score_chunk(pairs: list[tuple[str, str]]) -> list[RewardResult]:
    return [_WORKER_SCORER.score(response, truth) for response, truth in pairs]


class RewardPool:
    """``score(responses, ground_truths)`` with ``num_workers`` processes.

    Args:
        name: reward function (registered name or ``module:function``).
        timeout_s: bound of each call (see :class:`RewardScorer`).
        num_workers: worker processes; 1 scores in this process.
        min_parallel: rounds smaller than this are scored in this process.
        error_score: the score of a call that fails or times out.
        memory_mb: memory cap of each reward worker process (see :class:`RewardScorer`); 0: none.
    """

    def __init__(
        self,
        name: str,
        timeout_s: float,
        num_workers: int,
        min_parallel: int = 256,
        error_score: float = -1.0,
        memory_mb: int = DEFAULT_WORKER_MEMORY_MB,
    ) -> None:
        self.local = RewardScorer(name, timeout_s, error_score, memory_mb)
        self.num_workers = max(1, num_workers)
        self.min_parallel = min_parallel
        self._executor: ProcessPoolExecutor | None = None
        if self.num_workers > 1:
            self._executor = ProcessPoolExecutor(
                self.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(name, timeout_s, error_score, memory_mb),
            )

    def score(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[RewardResult]:
        """One result per response, in order; never raises for what the reward function does."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"responses has {len(responses)} entries but ground_truths has {len(ground_truths)}")
        pairs = list(zip(responses, ground_truths))
        if self._executor is None or len(pairs) < self.min_parallel:
            return [self.local.score(r, g) for r, g in pairs]
        size = -(-len(pairs) // self.num_workers)
        chunks = [pairs[i : i + size] for i in range(0, len(pairs), size)]
        return [result for chunk in self._executor.map(_score_chunk, chunks) for result in chunk]

    def close(self) -> None:
        """Stop the worker processes."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self.local.close()
