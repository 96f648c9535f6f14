"""Reward functions by name, and a runner that bounds every call in time.

A reward function maps ``(response, ground_truth)`` to a :class:`RewardResult` (or a
number, or a dict with ``score``). Functions are found by a registered name
(``dapo_math``, ``math_verify``) or as ``module:function`` for a user's own.

Nothing a reward function does may hang the trainer. Functions registered as
``bounded`` (their running time is bounded by construction, like ``dapo_math``, which
reads a fixed-size tail of the response) run in-process; the rest run in a worker
process that :class:`RewardScorer` kills and restarts when a call exceeds
``timeout_s``. Either way a call that exceeds the bound scores as wrong and is counted in
the ``timeouts`` metric; a call that raises scores as wrong and is counted in ``errors``.

Nor may one exhaust the machine's memory: a worker caps its own address space
(``RLIMIT_AS``) at ``memory_mb`` beyond what it has mapped when it starts, so a runaway
allocation is a ``MemoryError`` in that call (a reward error) rather than the kernel's
OOM killer choosing a process, perhaps the trainer's. A worker that dies or does not
come up while starting scores reward errors too; starting is retried after
``START_RETRY_S``, not once per response.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import math
import multiprocessing
import time
from collections.abc import Sequence
from typing import Any, Optional

from dapo_megatron.algo.rewards.base import REGISTRY, RewardFn, RewardResult

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0
"""Default bound of a worker's start (spawning Python, importing the reward's module)."""

START_RETRY_S = 30.0
"""After a worker failed to start, calls within this many seconds score the same error at
once; the next call after it starts a worker again. Starting one per response instead
would cost a start (up to the start bound) per response, for as long as the cause lasts."""

DEFAULT_WORKER_MEMORY_MB = 4096
"""Default of ``memory_mb`` (``algorithm.reward_worker_memory_mb``)."""

MAX_ABS_SCORE = 1e6
"""Largest |score| a reward function may return; a larger one is a reward error, as a NaN
is. Advantages are a group's (score - mean) / std, computed in float32: a score near
1e308 is infinite there (and its square overflows float64 too), so one such score makes
its group's advantages NaN, which stops the step. 1e6 keeps the group statistics many
orders of magnitude from overflow and is far beyond any sensible reward."""


def _ensure_builtins() -> None:
    # Importing the modules registers them (they import only :mod:`base`, not this module).
    from dapo_megatron.algo.rewards import dapo_math, math_verify_reward  # noqa: F401


def available_rewards() -> list[str]:
    """Names of the registered reward functions."""
    _ensure_builtins()
    return sorted(REGISTRY)


def resolve_reward(name: str) -> tuple[RewardFn, bool]:
    """``(function, bounded)`` for a registered name or a ``module:function`` path."""
    _ensure_builtins()
    if name in REGISTRY:
        entry = REGISTRY[name]
        return entry.fn, entry.bounded
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"reward {name!r}: cannot import module {module_name!r}: {exc}") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"reward {name!r}: module {module_name!r} has no function {attr!r}")
        return fn, False
    raise ValueError(
        f"unknown reward {name!r}; registered: {', '.join(available_rewards())}, or name your own as module:function"
    )


def _number(value: Any) -> Optional[float]:
    """``value`` as a float when it is a real number: Python's or NumPy's (any scalar with
    ``__float__`` and no length, e.g. ``np.float32``, ``np.int64``, a 0-d tensor); bools
    count 1.0 / 0.0. Otherwise None."""
    if isinstance(value, (str, bytes, dict, RewardResult)):
        return None
    if hasattr(value, "__len__") and getattr(value, "ndim", None) != 0:  # sequences; 0-d arrays are scalars
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def to_result(value: Any) -> RewardResult:
    """Turn what a reward function returned into a RewardResult (or raise TypeError or
    ValueError): a RewardResult; a number (Python or NumPy; a bool means correct 1.0 or
    wrong 0.0), correct when > 0; a dict with ``score`` (and optionally ``correct`` and
    ``prediction``). A NaN or infinite score, or one beyond ±``MAX_ABS_SCORE``, is refused
    (ValueError)."""
    if isinstance(value, RewardResult):
        result = value
    elif (number := _number(value)) is not None:
        result = RewardResult(score=number, correct=number > 0, prediction=None)
    elif isinstance(value, dict) and "score" in value:
        score = _number(value["score"])
        if score is None:
            raise TypeError(f"a reward function returned a score of type {type(value['score']).__name__}")
        result = RewardResult(
            score=score, correct=bool(value.get("correct", score > 0)), prediction=value.get("prediction")
        )
    else:
        raise TypeError(f"a reward function returned {type(value).__name__}; expected a number, dict or RewardResult")
    if not math.isfinite(result.score):
        raise ValueError(f"a reward function returned the non-finite score {result.score}")
    if abs(result.score) > MAX_ABS_SCORE:
        raise ValueError(
            f"a reward function returned the score {result.score:g}, which is beyond ±{MAX_ABS_SCORE:g} "
            "(group advantages of such scores overflow); scale the reward function's scores down"
        )
    return result


def _call(fn: RewardFn, response: str, ground_truth: str, error_score: float) -> RewardResult:
    try:
        return to_result(fn(response, ground_truth))
    except Exception as exc:  # a reward function's bug must not stop training
        return RewardResult(score=error_score, correct=False, prediction=None, error=f"{type(exc).__name__}: {exc}")


def _cap_address_space(memory_mb: int) -> None:
    """Let this process map at most ``memory_mb`` MiB more than it has mapped now (its
    soft ``RLIMIT_AS``; never raised above a lower limit already set). Counted from the
    current size because what the interpreter and its imports have mapped already (torch's
    libraries: hundreds of MB to gigabytes of address space, mostly never touched) says
    nothing about what a reward call may use; without ``/proc`` the cap counts from zero."""
    import resource

    try:
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        mapped = 0
    limit = mapped + memory_mb * 2**20
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    for existing in (soft, hard):
        if existing != resource.RLIM_INFINITY:
            limit = min(limit, existing)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError) as exc:  # a platform that does not enforce RLIMIT_AS
        logger.warning("reward worker: cannot cap its memory at %s MiB (%s); running without a cap", memory_mb, exc)


def _worker_main(conn, name: str, memory_mb: int) -> None:
    """Worker process loop: cap memory, resolve the function once, then score requests
    until None."""
    try:
        if memory_mb > 0:
            _cap_address_space(memory_mb)
        fn, _ = resolve_reward(name)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the scorer closed its end (its process ended): nothing more to score
            return
        if request is None:
            return
        conn.send(_call(fn, *request))  # request: (response, ground truth, error score)


class RewardScorer:
    """Scores responses with one reward function, each call bounded by ``timeout_s``; a
    call that raises, returns something unusable (or a NaN, infinite or too large score),
    exceeds the bound, or runs in a worker that cannot start, scores ``error_score``, not
    correct.

    ``memory_mb``: address space a worker may map beyond what it has mapped when it starts
    (0: no cap); ``start_timeout_s``: bound of a worker's start.
    """

    def __init__(
        self,
        name: str,
        timeout_s: float = 5.0,
        error_score: float = -1.0,
        memory_mb: int = DEFAULT_WORKER_MEMORY_MB,
        start_timeout_s: float = _STARTUP_TIMEOUT_S,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if memory_mb < 0:
            raise ValueError(f"memory_mb={memory_mb} must be >= 0 (0: no cap)")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s={start_timeout_s} must be > 0")
        self.name = name
        self.timeout_s = timeout_s
        self.error_score = error_score
        self.memory_mb = memory_mb
        self.start_timeout_s = start_timeout_s
        self._fn, self._bounded = resolve_reward(name)
        self._process = None
        self._conn = None
        self._start_failure: Optional[str] = None
        self._start_failed_at = 0.0
        self._counts = {"calls": 0, "correct": 0, "timeouts": 0, "errors": 0}
        self._warned_error = False
        atexit.register(self.close)

    def _timed_out(self) -> RewardResult:
        return RewardResult(score=self.error_score, correct=False, prediction=None, timed_out=True)

    def _start_worker(self) -> None:
        """Start a worker and wait until it is ready; RuntimeError (the worker stopped) if it
        does not come up within ``start_timeout_s``, reports a failure or exits."""
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(target=_worker_main, args=(child, self.name, self.memory_mb), daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        try:
            if not parent.poll(self.start_timeout_s):
                raise RuntimeError(f"reward worker for {self.name!r} did not start within {self.start_timeout_s:g} s")
            try:
                status, detail = parent.recv()
            except (EOFError, OSError):
                self._process.join(timeout=5)
                raise RuntimeError(
                    f"reward worker for {self.name!r} failed to start: it exited (exit code "
                    f"{self._process.exitcode}) before it was ready"
                ) from None
            if status != "ready":
                hint = ""
                if detail.startswith("MemoryError") and self.memory_mb:
                    hint = f" (its memory cap: algorithm.reward_worker_memory_mb={self.memory_mb})"
                raise RuntimeError(f"reward worker for {self.name!r} failed to start: {detail}{hint}")
        except RuntimeError:
            self.close()
            raise

    def _worker_unavailable(self) -> Optional[RewardResult]:
        """None when a worker is running or starts now; else the error to score: a start
        failed now, or less than ``START_RETRY_S`` ago."""
        if self._process is not None and self._process.is_alive():
            return None
        if self._start_failure is None or time.monotonic() - self._start_failed_at >= START_RETRY_S:
            try:
                self._start_worker()
                self._start_failure = None
                return None
            except RuntimeError as exc:
                self._start_failure, self._start_failed_at = str(exc), time.monotonic()
                logger.warning(
                    "%s; scoring reward errors (algorithm.reward_error_score) for %.0f s, then starting it again",
                    exc,
                    START_RETRY_S,
                )
        return RewardResult(score=self.error_score, correct=False, prediction=None, error=self._start_failure)

    def _score_in_worker(self, response: str, ground_truth: str) -> RewardResult:
        unavailable = self._worker_unavailable()
        if unavailable is not None:
            return unavailable
        try:
            self._conn.send((response, ground_truth, self.error_score))
            if self._conn.poll(self.timeout_s):
                return self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            self.close()
            return RewardResult(
                score=self.error_score, correct=False, prediction=None, error=f"reward worker died: {exc}"
            )
        # Over the bound: the worker may be stuck forever; kill it, a new one starts next call.
        self.close()
        return self._timed_out()

    def score(self, response: str, ground_truth: str) -> RewardResult:
        """Score one response; never raises for anything the reward function does."""
        if self._bounded:
            start = time.perf_counter()
            result = _call(self._fn, response, ground_truth, self.error_score)
            if time.perf_counter() - start > self.timeout_s:
                result = self._timed_out()
        else:
            result = self._score_in_worker(response, ground_truth)
        self._counts["calls"] += 1
        self._counts["correct"] += int(result.correct)
        self._counts["timeouts"] += int(result.timed_out)
        if result.error is not None:
            self._counts["errors"] += 1
            if not self._warned_error:
                self._warned_error = True
                logger.warning(
                    "reward function %r failed, scoring %s (algorithm.reward_error_score) and counting it in "
                    "reward/errors (reported once): %s",
                    self.name,
                    self.error_score,
                    result.error,
                )
        return result

    def score_batch(
        self, responses: Sequence[str], ground_truths: Sequence[str]
    ) -> tuple[list[RewardResult], dict[str, float]]:
        """Score responses against their ground truths; returns results and this batch's metrics."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"responses has {len(responses)} entries but ground_truths has {len(ground_truths)}")
        results = [self.score(r, g) for r, g in zip(responses, ground_truths)]
        n = max(len(results), 1)
        metrics = {
            "accuracy": sum(r.correct for r in results) / n,
            "score_mean": sum(r.score for r in results) / n,
            "timeouts": float(sum(r.timed_out for r in results)),
            "errors": float(sum(r.error is not None for r in results)),
        }
        return results, metrics

    def metrics(self) -> dict[str, float]:
        """Totals since this scorer was made: calls, correct, timeouts, errors."""
        return {key: float(value) for key, value in self._counts.items()}

    def close(self) -> None:
        """Stop the worker process, if any."""
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join(timeout=5)
            self._process = None


_SCORERS: dict[tuple[str, float], RewardScorer] = {}  # score_response's, default error score


def score_response(name: str, response: str, ground_truth: str, *, timeout_s: float = 5.0) -> RewardResult:
    """Score one response with the reward called ``name`` (registered or ``module:function``).

    The call is bounded by ``timeout_s``; a response that exceeds it scores as wrong with
    ``timed_out=True``. Scorers (and their worker processes) are reused across calls.
    """
    key = (name, float(timeout_s))
    scorer = _SCORERS.get(key)
    if scorer is None:
        scorer = _SCORERS[key] = RewardScorer(name, timeout_s)
    return scorer.score(response, ground_truth)
