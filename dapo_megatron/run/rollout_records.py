"""What the model wrote: every step's rollouts, in the run folder, for people and pandas.

Each recorded step is one file, ``<run>/rollouts/step_NNNNNN.jsonl.gz``: one JSON object
per response (gzip'd JSON lines: ``pandas.read_json(path, lines=True)`` reads it, and so
does ``zcat``). A response's row says

- which prompt it answers (``prompt_id``, ``prompt``, ``group``) and what it wrote
  (``response``, ``response_tokens``, ``finish_reason``);
- how it was scored: ``reward`` = ``score`` + ``overlong_penalty``, ``correct``,
  ``prediction`` (the answer the reward function read);
- whether it was trained: ``kept``, or ``dropped`` with why (``all_right`` and
  ``all_wrong``: dynamic sampling; ``aborted``: an engine gave up on its group; ``stale``:
  a carried group too old; ``surplus``: beyond the batch, not carried), and for a trained
  one its ``advantage`` and ``trained_tokens`` (0 when the overlong filter masked it);
- the engine's and the actor's view of it: ``engine_log_prob_mean``,
  ``actor_log_prob_mean`` and ``log_prob_gap_max`` (the largest per-token difference),
  over its trained tokens, when the actor computed old log-probs;
- the policy versions that sampled it (``policy_versions``: oldest and newest) and, for a
  multi-turn episode, ``turns``, ``tool_calls``, ``tool_errors``, ``observation_tokens``
  and ``episode``: its turns in order, each ``{"by": "model" | "environment", "text"}``.

Validation writes ``<run>/rollouts/val_step_NNNNNN.jsonl.gz`` (prompt, response, reward,
correct) at each validation.

``logging.rollout_records_every`` says which steps (0: none) and
``logging.rollout_records_groups`` how many groups of a step (a seeded draw among kept
and dropped alike; 0: all). Rows are built and written by a thread of their own, off
the step's path; a file appears whole or not at all (written beside, then renamed), and
a resumed run first removes the records of the steps after its checkpoint, as
``metrics.jsonl`` drops its lines, so that no step is recorded twice.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dapo_megatron.config import LoggingConfig

logger = logging.getLogger(__name__)

RECORDS_DIR = "rollouts"


@dataclass
class StepRollouts:
    """What a step's records are made of: its trained samples (in the batch's row order),
    the batch's advantages and loss mask, both views of the log-probs (the actor's may be
    None), and the groups it dropped."""

    samples: list
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    engine_log_probs: torch.Tensor
    actor_log_probs: Optional[torch.Tensor]
    dropped: list


def record_path(run_dir: str | Path, step: int, kind: str = "step") -> Path:
    """Where step ``step``'s records are (``kind``: ``step`` or ``val_step``)."""
    return Path(run_dir) / RECORDS_DIR / f"{kind}_{step:06d}.jsonl.gz"


def episode_turns(sample, decode) -> list[dict]:
    """A multi-turn episode's response as its turns: ``{"by": "model" | "environment",
    "text": ...}``, one per run of tokens the model sampled or the environment wrote."""
    turns: list[dict] = []
    start = 0
    mask = sample.model_mask
    for end in range(1, len(mask) + 1):
        if end == len(mask) or mask[end] != mask[start]:
            by = "model" if mask[start] else "environment"
            turns.append({"by": by, "text": decode(sample.response_ids[start:end])})
            start = end
    return turns


def record_step(path: Path) -> Optional[int]:
    """The step a records file is of (``step_000012.jsonl.gz``, ``val_step_000012...``:
    12); None for another file."""
    number = path.name.split(".")[0].rsplit("_", 1)[-1]
    return int(number) if number.isdigit() else None


def _sample_row(sample, kept: bool, dropped: Optional[str], decode=None) -> dict:
    versions = sample.token_versions or [sample.policy_version]
    row = {
        "group": list(sample.group_id),
        "prompt_id": sample.prompt.prompt_id,
        "data_source": sample.prompt.data_source,
        "prompt": sample.prompt.text,
        "ground_truth": sample.prompt.ground_truth,
        "response": sample.text,
        "response_tokens": len(sample.response_ids),
        "finish_reason": sample.finish_reason,
        "reward": sample.reward,
        "score": sample.score,
        "overlong_penalty": sample.overlong_penalty,
        "correct": sample.correct,
        "prediction": sample.prediction,
        "kept": kept,
        "dropped": dropped,
        "policy_versions": [min(versions), max(versions)],
    }
    if sample.episode is not None:
        row.update(
            turns=sample.episode.turns,
            tool_calls=sample.episode.tool_calls,
            tool_errors=sample.episode.tool_errors,
            observation_tokens=sample.episode.observation_tokens,
        )
    if sample.model_mask is not None and decode is not None:
        row["episode"] = episode_turns(sample, decode)
    return row


def step_rows(step: int, rollouts: StepRollouts, groups: int, seed: int, decode=None) -> list[dict]:
    """The rows of step ``step``: every response of ``groups`` groups drawn with a seed of
    the step (all of them when ``groups`` is 0), trained ones first; a multi-turn
    episode's turns too, with ``decode`` (token ids -> text)."""
    members: dict[tuple, list[tuple[object, Optional[int], Optional[str]]]] = {}
    for index, sample in enumerate(rollouts.samples):
        members.setdefault(("kept", *sample.group_id), []).append((sample, index, None))
    for group, reason in rollouts.dropped:
        members.setdefault((reason, *group[0].group_id), []).extend((s, None, reason) for s in group)
    keys = list(members)
    if groups and len(keys) > groups:
        chosen = set(random.Random(seed * 1_000_003 + step).sample(range(len(keys)), groups))
        keys = [key for index, key in enumerate(keys) if index in chosen]
    # The trained rows' figures, for the whole batch at once.
    mask = rollouts.loss_mask.float()
    counts = mask.sum(dim=1)
    engine_means = (rollouts.engine_log_probs.float() * mask).sum(dim=1) / counts.clamp(min=1)
    actor = rollouts.actor_log_probs
    if actor is not None:
        actor_means = (actor.float() * mask).sum(dim=1) / counts.clamp(min=1)
        gaps = ((actor.float() - rollouts.engine_log_probs.float()).abs() * mask).amax(dim=1)
    rows = []
    for key in keys:
        for sample, index, reason in members[key]:
            row = {"step": step, **_sample_row(sample, index is not None, reason, decode)}
            if index is not None:
                row["advantage"] = float(rollouts.advantages[index])
                row["trained_tokens"] = int(counts[index])
                if actor is not None and counts[index] > 0:
                    row["engine_log_prob_mean"] = float(engine_means[index])
                    row["actor_log_prob_mean"] = float(actor_means[index])
                    row["log_prob_gap_max"] = float(gaps[index])
            rows.append(row)
    return rows


def validation_rows(step: int, samples: list, decode=None) -> list[dict]:
    """The rows of a validation at step ``step``: every response."""
    return [{"step": step, **_sample_row(sample, False, None, decode)} for sample in samples]


def write_rows(path: Path, rows: list[dict]) -> int:
    """``rows`` to ``path`` as gzip'd JSON lines, whole or not at all; its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with gzip.open(partial, "wt", encoding="utf-8", compresslevel=6) as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(partial, path)
    return path.stat().st_size


class RolloutRecorder:
    """Writes the records (see the module docstring) in a thread of its own."""

    def __init__(
        self,
        run_dir: str | Path,
        config: LoggingConfig,
        seed: int,
        *,
        resume_after: Optional[int] = None,
        tokenizer=None,
    ):
        """``tokenizer``: decodes a multi-turn episode's turns (without it, rows hold the
        whole response only)."""
        self.run_dir, self.config, self.seed = Path(run_dir), config, seed
        self.decode = None if tokenizer is None else lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-records")
        self._pending: list[Future] = []
        self.written: list[tuple[int, int, float]] = []  # (step, bytes, seconds)
        if resume_after is not None:
            self._drop_after(resume_after)

    def _drop_after(self, step: int) -> None:
        folder = self.run_dir / RECORDS_DIR
        for path in folder.glob("*.jsonl.gz") if folder.is_dir() else []:
            recorded = record_step(path)
            if recorded is not None and recorded > step:
                path.unlink()

    def wants(self, step: int) -> bool:
        """Whether step ``step`` is recorded."""
        every = self.config.rollout_records_every
        return every > 0 and step % every == 0

    def record_step(self, step: int, rollouts: StepRollouts) -> None:
        """Step ``step``'s records, built and written in the background."""
        if self.wants(step):
            groups = self.config.rollout_records_groups
            self._submit(step, lambda: step_rows(step, rollouts, groups, self.seed, self.decode))

    def record_validation(self, step: int, samples: list) -> None:
        """A validation's records, in the background (every validation is recorded while
        ``rollout_records_every`` is not 0)."""
        if self.config.rollout_records_every > 0:
            self._submit(step, lambda: validation_rows(step, samples, self.decode), kind="val_step")

    def _submit(self, step: int, rows, kind: str = "step") -> None:
        def write() -> None:
            start = time.perf_counter()
            size = write_rows(record_path(self.run_dir, step, kind), rows())
            self.written.append((step, size, time.perf_counter() - start))

        self._pending = [future for future in self._pending if not future.done()]
        self._pending.append(self._pool.submit(write))

    def close(self) -> None:
        """Wait for the writes in flight; a failed one is logged, not raised (the records
        are for people: a full disk must not end a run)."""
        for future in self._pending:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001
                logger.warning("writing rollout records failed: %s", exc)
        self._pool.shutdown(wait=True)
        if self.written:
            total = sum(size for _, size, _ in self.written)
            seconds = sum(s for _, _, s in self.written)
            logger.info(
                "rollout records: %d file(s) in %s, %.1f MB, %.3f s of writing each on average (off the steps' path)",
                len(self.written),
                self.run_dir / RECORDS_DIR,
                total / 1e6,
                seconds / len(self.written),
            )

    def __enter__(self) -> RolloutRecorder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
