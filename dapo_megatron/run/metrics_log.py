"""Where a run's metrics go: TensorBoard, ``metrics.jsonl``, and one console line a step.

Every metric of a step is written to all three at once, under the same names, so a
dashboard, a script reading the JSONL and a person watching the console see the same
numbers. TensorBoard events live in ``<run>/tensorboard`` and the JSONL beside them as
``<run>/metrics.jsonl`` (one object per line: ``{"step": k, "<name>": value, ...}``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

import torch

from dapo_megatron.config import LoggingConfig

# (metric, console label, format) of the console line, in order; missing ones are skipped.
_CONSOLE = (
    ("reward/score_mean", "reward", "{:+.3f}"),
    ("reward/accuracy", "acc", "{:.3f}"),
    ("response/length_mean", "len", "{:.1f}"),
    ("dynamic_sampling/kept", "kept", "{:.0f}"),
    ("dynamic_sampling/generated", "of", "{:.0f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("actor/approx_kl", "kl", "{:.1e}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"),
    ("time/step", "step_s", "{:.2f}"),
)


def duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h07m``: a time for people."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def validation_course(validations: list[tuple[int, float]]) -> str:
    """``first 55.0% (step 0), best 99.0% (step 20), last 98.0% (step 40)`` of
    ``(step, accuracy)`` pairs in step order (the best: the earliest of the highest)."""
    (first_step, first), (last_step, last) = validations[0], validations[-1]
    best_step, best = max(validations, key=lambda pair: (pair[1], -pair[0]))
    return (
        f"first {first:.1%} (step {first_step}), best {best:.1%} (step {best_step}), last {last:.1%} (step {last_step})"
    )


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")  # an unreadable (half-written) line is dropped


class MetricsLogger:
    """Writes each step's metrics to TensorBoard, ``metrics.jsonl`` and the console."""

    def __init__(
        self,
        run_dir: str | Path,
        config: LoggingConfig,
        num_steps: int,
        stream: TextIO = sys.stdout,
        *,
        resume_after: Optional[int] = None,
        sink=None,
    ):
        """``resume_after``: the step a resumed run continues after; records of later steps
        (written after that checkpoint, before the run stopped) are dropped from
        ``metrics.jsonl`` and TensorBoard, so each step appears once. ``sink``: one more
        place every metric goes (:class:`~dapo_megatron.run.wandb_sink.WandbSink`)."""
        self.sink = sink
        self.run_dir = Path(run_dir)
        self.config = config
        self.num_steps = num_steps
        self.stream = stream
        path = self.run_dir / "metrics.jsonl"
        if resume_after is not None and path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True) if _step_of(line) <= resume_after]
            staged = path.with_suffix(".jsonl.tmp")
            staged.write_text("".join(kept))
            staged.replace(path)
        self.jsonl = path.open("a")
        self.writer = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_after is None else resume_after + 1
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)
        self._start = time.perf_counter()
        self._first_step = (resume_after or 0) + 1  # the first step this process trains

    def log(
        self, step: int, metrics: dict[str, float], *, console: Optional[bool] = None, histograms: Optional[dict] = None
    ) -> None:
        """Write ``metrics`` of ``step`` everywhere (the console every ``log_every`` steps),
        and ``histograms`` (name -> values) to TensorBoard."""
        clean = {name: float(value) for name, value in sorted(metrics.items())}
        self.jsonl.write(json.dumps({"step": step, **clean}, allow_nan=True) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for name, value in clean.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.sink is not None:
            self.sink.log(step, clean)
        show = console if console is not None else (step % max(1, self.config.log_every) == 0)
        if show:
            self.stream.write(self.format_line(step, clean) + "\n")
            self.stream.flush()
        for name, values in (histograms or {}).items():
            self.log_histogram(step, name, values)

    def log_histogram(self, step: int, name: str, values) -> None:
        """A distribution (e.g. response lengths) to TensorBoard only."""
        if self.writer is not None and len(values):
            self.writer.add_histogram(name, torch.as_tensor(values, dtype=torch.float32), step)

    def format_line(self, step: int, metrics: dict[str, float]) -> str:
        """``step 12/150 [###.......]  reward +0.125  acc 0.562 ...`` (or the validation line)."""
        width = 20
        done = min(width, round(width * step / max(1, self.num_steps)))
        head = f"step {step:>{len(str(self.num_steps))}}/{self.num_steps} [{'#' * done}{'.' * (width - done)}]"
        parts = [head]
        if any(name.startswith("val/") for name in metrics) and not any(name.startswith("reward/") for name in metrics):
            parts.append("validation")
            for name in ("val/accuracy", "val/pass_at_k", "val/response_length_mean"):
                if name in metrics:
                    parts.append(f"{name.removeprefix('val/')} {metrics[name]:.3f}")
        else:
            for name, label, fmt in _CONSOLE:
                value = metrics.get(name)
                if value is not None and not math.isnan(value):
                    parts.append(f"{label} {fmt.format(value)}")
        elapsed = time.perf_counter() - self._start
        parts.append(f"elapsed {elapsed:.0f}s")
        done_here = step - self._first_step + 1
        if "val/accuracy" not in metrics and 0 < done_here and step < self.num_steps:
            parts.append(f"eta {duration(elapsed / done_here * (self.num_steps - step))}")
        return "  ".join(parts)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Flush and close the files."""
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
