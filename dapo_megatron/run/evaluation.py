"""``dapo-megatron eval``: avg@k and pass@k of a checkpoint, exactly as the trainer validates.

DAPO reports AIME 2024 as avg@32: 32 responses per problem sampled at temperature 1.0 and
top-p 0.7, and the mean accuracy over all of them. This command computes that number for
any checkpoint with the run config's validation settings (``data.val_files``,
``rollout.val_n_samples``, ``rollout.val_temperature``, ``rollout.val_top_p``) through the
same code the trainer validates with (:func:`evaluate_policy`: the same engines,
reward and metrics), so an ``eval`` figure and a validation curve are comparable.

Problems repeated in the files (the published AIME parquet repeats each of its 30 problems
32 times) are counted once: k samples per problem already average over the sampling.
A Megatron checkpoint is first converted to HF safetensors by the converter (exact, and
verified against transformers up to its size limit); the engines then serve those weights.
Results: ``summary.json`` (overall and per data source), ``problems.jsonl`` (one record per
problem: its k outcomes and the answers read from them) and a table on the console.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dapo_megatron.algo.rewards.pool import RewardPool
from dapo_megatron.ckpt.convert import export_hf
from dapo_megatron.config import Config, ConfigError, RolloutConfig
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.run.signals import StopNow
from dapo_megatron.run.system import start_rewards
from dapo_megatron.sampling.episodes import episode_rules
from dapo_megatron.sampling.rounds import generate_and_score
from dapo_megatron.sampling.samples import Sample, validation_metrics

logger = logging.getLogger(__name__)


@dataclass
class EvalResult:
    """What ``eval`` measured and where it wrote it."""

    summary: dict
    """``{"overall": {...}, "by_source": {source: {...}}, ...}`` with avg@k and pass@k."""
    problems: list[dict]
    """One record per distinct problem."""
    out_dir: Path
    """Folder holding ``summary.json`` and ``problems.jsonl``."""


def evaluate(
    config: Config,
    *,
    ckpt: Optional[str] = None,
    hf_dir: Optional[str] = None,
    out_dir: Optional[str] = None,
) -> EvalResult:
    """Evaluate a Megatron checkpoint (``ckpt``: a checkpoint or a save folder with
    ``latest``) or an HF folder (``hf_dir``) on ``data.val_files``."""
    from dapo_megatron.data import load_tokenizer, validation_dataset
    from dapo_megatron.orchestration.cluster import RayCluster

    if (ckpt is None) == (hf_dir is None):
        raise ConfigError("eval needs exactly one of --ckpt (a Megatron checkpoint) and --hf-dir (an HF folder)")
    d, r = config.data, config.rollout
    if not d.val_files:
        raise ConfigError("eval needs data.val_files (the problems to evaluate on); none are set")
    source = Path(ckpt or hf_dir)
    if not source.exists():
        raise ConfigError(f"{'--ckpt' if ckpt else '--hf-dir'} {source} does not exist")
    out = Path(out_dir) if out_dir else default_eval_dir(source)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(
            f"eval output folder {out} already holds files; choose another --out (nothing is overwritten)"
        )
    out.mkdir(parents=True, exist_ok=True)

    if ckpt:
        weights = out / "hf"
        logger.info("converting %s to HF safetensors in %s", ckpt, weights)
        export_hf(ckpt, config, weights)
    else:
        weights = Path(hf_dir)
    tokenizer = load_tokenizer(d, config.model.hf_weights_folder or weights)
    dataset = validation_dataset(d.val_files, tokenizer, d, r.max_prompt_length)
    start = time.perf_counter()
    with ExitStack() as stack:
        cpus = max(os.cpu_count() or 1, r.num_engines + 1)
        stack.enter_context(RayCluster(config.ray, out, config.ray.num_cpus or cpus))
        rewards = start_rewards(config.algorithm, stack)
        engines = RolloutWorkers(config, str(weights))
        stack.callback(engines.shutdown)
        metrics, samples = evaluate_policy(engines, rewards, dataset.prompts, config, tokenizer)
    from dapo_megatron.sampling.samples import problem_results

    problems = problem_results(samples)
    summary = _summary(metrics, problems, config, source, time.perf_counter() - start, dataset.stats)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    with (out / "problems.jsonl").open("w") as handle:
        for record in problems:
            handle.write(json.dumps(record) + "\n")
    return EvalResult(summary, problems, out)


RUN_FOLDER_MARKERS = ("metrics.jsonl", "config.yaml")
"""Files a run folder of ``train`` holds."""


def default_eval_dir(source: Path) -> Path:
    """``eval/<name>-<time>`` in the run folder the evaluated weights belong to (a
    checkpoint under ``<run>/checkpoints``, a run's ``hf_final``: the nearest folder
    above ``source`` that holds a run's files), else next to ``source`` itself."""
    name = f"{source.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for folder in list(source.resolve().parents)[:3]:
        if any((folder / marker).is_file() for marker in RUN_FOLDER_MARKERS):
            return folder / "eval" / name
    return source.resolve().parent / "eval" / name


def _summary(
    metrics: dict[str, float], problems: list[dict], config: Config, source: Path, seconds: float, stats: dict
) -> dict:
    """avg@k (mean accuracy over every sample) and pass@k (share of problems solved by at
    least one sample), overall and per data source: the validation metrics the trainer
    logs (``val/...``), with the mean response length."""

    def scores(prefix: str, records: list[dict]) -> dict:
        attempts = sum(p["k"] for p in records)
        return {
            "problems": int(metrics[f"{prefix}/num_problems"]),
            "avg_at_k": metrics[f"{prefix}/accuracy"],
            "pass_at_k": metrics[f"{prefix}/pass_at_k"],
            "mean_response_length": sum(sum(p["response_lengths"]) for p in records) / max(attempts, 1),
        }

    sources = sorted({p["data_source"] for p in problems})
    r = config.rollout
    return {
        "source": str(source),
        "k": r.val_n_samples,
        "temperature": r.val_temperature,
        "top_p": r.val_top_p,
        "max_response_length": r.max_response_length,
        "seed": r.seed,
        "val_files": list(config.data.val_files),
        "rows_read": stats["rows"],
        "repeated_rows_counted_once": stats["duplicates_removed"],
        "overall": scores("val", problems),
        "by_source": {
            name: scores(f"val/{name}", [p for p in problems if p["data_source"] == name]) for name in sources
        },
        "seconds": seconds,
    }


def format_table(summary: dict) -> str:
    """The console table of ``eval``."""
    k = summary["k"]
    header = f"{'data source':<24} {'problems':>8} {f'avg@{k}':>8} {f'pass@{k}':>8} {'mean len':>9}"
    lines = [header, "-" * len(header)]
    rows = list(summary["by_source"].items()) + [("overall", summary["overall"])]
    for name, s in rows:
        lines.append(
            f"{name:<24} {s['problems']:>8} {s['avg_at_k']:>8.1%} {s['pass_at_k']:>8.1%} {s['mean_response_length']:>9.1f}"
        )
    if summary["repeated_rows_counted_once"]:
        lines.append(
            f"({summary['rows_read']} rows, {summary['repeated_rows_counted_once']} repeats counted once; "
            f"k = {k} samples per problem at temperature {summary['temperature']:g}, top-p {summary['top_p']:g})"
        )
    return "\n".join(lines)


def validation_sampling(rollout: RolloutConfig, tokenizer) -> SamplingParams:
    """``rollout.val_*``: the sampling of validation and ``eval`` (seeded: repeatable)."""
    r = rollout
    return SamplingParams(
        r.val_temperature, r.val_top_p, -1, r.max_response_length, (tokenizer.eos_token_id,), seed=r.seed
    )


def evaluate_policy(
    engines: RolloutWorkers, rewards: RewardPool, prompts: list, config: Config, tokenizer
) -> tuple[dict[str, float], list[Sample]]:
    """avg@k and pass@k of the engines' policy on ``prompts`` (k = rollout.val_n_samples),
    overall and per data source; and the scored samples."""
    start = time.perf_counter()
    n = config.rollout.val_n_samples
    samples = generate_and_score(
        engines,
        rewards,
        prompts,
        validation_sampling(config.rollout, tokenizer),
        n,
        -1,
        config.algorithm,
        tokenizer,
        {},
        episode_rules(config.rollout, tokenizer),
    )
    return {**validation_metrics(samples, n), "time/validate": time.perf_counter() - start}, samples


class Validation:
    """The trainer's validation: avg@k and pass@k of the engines' policy on the validation
    prompts (:func:`evaluate_policy`), logged with the step, to the console too; nothing
    without validation data."""

    def __init__(self, system, val_data, config: Config, tokenizer, metrics_log, records=None) -> None:
        """``records``: a :class:`~dapo_megatron.run.rollout_records.RolloutRecorder` that
        writes each validation's responses."""
        self.system, self.val_data, self.config = system, val_data, config
        self.tokenizer, self.metrics_log, self.records = tokenizer, metrics_log, records
        self.history: list[tuple[int, float]] = []  # (step, accuracy) of every validation

    def __call__(self, step: int) -> Optional[float]:
        """Validate after ``step``; the accuracy (None without validation data)."""
        if self.val_data is None:
            return None
        values, samples = evaluate_policy(
            self.system.engines, self.system.rewards, self.val_data.prompts, self.config, self.tokenizer
        )
        self.metrics_log.log(step, values, console=True)
        if self.records is not None:
            self.records.record_validation(step, samples)
        self.history.append((step, values["val/accuracy"]))
        return values["val/accuracy"]

    def unless_stopped(self, step: int) -> None:
        """Validation during the run: a stop signal abandons it, as it does generation."""
        try:
            with self.system.stop.abortable():
                self(step)
        except StopNow:
            pass
