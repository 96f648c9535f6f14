"""The DAPO trainer: one module that reads top to bottom as a step of DAPO does.

A step (``docs/design.md``): take prompts; generate ``n`` responses each on the
rollout engines; score them (rule-based reward plus the soft overlong punishment);
dynamic sampling keeps groups whose answers disagree and draws more rounds until
``train_batch_size`` groups are kept; advantages by prompt identity; old log-probs from
the actor; ``train_batch_size * n / mini_batch_size`` DAPO updates; weight sync into
every engine; metrics; a checkpoint every ``checkpoint.save_every`` steps.

Steps 1-6 of a step are :class:`dapo_megatron.run.step.StepRunner` (shared with ``bench``);
this module runs the steps and what surrounds them: validation, checkpoints (their files
and resume are :class:`~dapo_megatron.run.resume.RunCheckpoint`'s), preemption, the
bad-step stop and the final export. Where work runs is hidden behind the
:class:`~dapo_megatron.run.system.RunningSystem`: ``actor`` (the Megatron ranks),
``engines`` (the rollout engines) and ``rewards`` (a process pool); the trainer never
touches a Ray handle.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from dapo_megatron.ckpt.convert import export_hf
from dapo_megatron.config import Config, ConfigError, engine_routing
from dapo_megatron.orchestration.actor_group import ActorGroup
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.run.evaluation import Validation
from dapo_megatron.run.metrics_log import MetricsLogger, duration, validation_course
from dapo_megatron.run.preflight import preflight
from dapo_megatron.run.resume import RunCheckpoint
from dapo_megatron.run.rollout_records import RECORDS_DIR, RolloutRecorder, step_rows
from dapo_megatron.run.signals import Preempted, StopNow, StopRequest
from dapo_megatron.run.step import GenerationAheadFailed, StepRunner
from dapo_megatron.run.system import load_run_data, reference_weights, start_system
from dapo_megatron.run.wandb_sink import WandbSink
from dapo_megatron.sampling.rounds import training_sampling

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """``trainer.max_bad_steps_in_a_row`` steps in a row had a NaN or infinite loss or gradient."""


def bad_metrics(metrics: dict[str, float]) -> list[str]:
    """What makes a step bad: updates skipped for a NaN or infinite loss or gradient, a
    non-finite loss, an infinite gradient norm. (A NaN gradient norm alone is not: it is
    what an empty or skipped update reports.)"""
    names = []
    if metrics.get("actor/nonfinite_updates", 0.0) > 0:
        names.append("actor/nonfinite_updates")
    if not math.isfinite(metrics.get("actor/loss", 0.0)):
        names.append("actor/loss")
    if math.isinf(metrics.get("actor/grad_norm", 0.0)):
        names.append("actor/grad_norm")
    return names


class BadStepCounter:
    """Counts steps in a row whose updates went non-finite (see :func:`bad_metrics`); logs
    each and raises :class:`TrainingDiverged` at ``limit`` (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0

    def record(self, step: int, metrics: dict[str, float], last_checkpoint: Optional[str]) -> None:
        bad = bad_metrics(metrics)
        self.in_a_row = self.in_a_row + 1 if bad else 0
        if not bad:
            return
        logger.warning(
            "step %d: %s not finite; those updates were skipped (%d bad step(s) in a row, limit %s)",
            step,
            ", ".join(bad),
            self.in_a_row,
            self.limit or "none",
        )
        if self.limit and self.in_a_row >= self.limit:
            raise TrainingDiverged(
                f"stopped at step {step}: {self.in_a_row} steps in a row with a NaN or infinite loss or gradient "
                f"(trainer.max_bad_steps_in_a_row={self.limit}); bad metrics: "
                + ", ".join(f"{name}={metrics[name]}" for name in bad)
                + (f"; last checkpoint {last_checkpoint} (--resume continues from it)" if last_checkpoint else "")
            )


class StopBudget:
    """Whether a stop signal's work fits in ``trainer.stop_grace_s``: a signal abandons
    generation, but the actor's log-probs and updates in flight finish and the save
    follows. Measured at each save; warns once when a step's actor work plus its save
    took longer (``plan`` can only estimate the save)."""

    ACTOR_PHASES = ("time/old_log_prob", "time/ref_log_prob", "time/train")

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.warned = False

    def check(self, step: int, metrics: dict[str, float], save_s: float) -> None:
        actor_s = sum(metrics.get(phase, 0.0) for phase in self.ACTOR_PHASES)
        if self.warned or actor_s + save_s <= self.grace_s:
            return
        self.warned = True
        logger.warning(
            "step %d: the actor's work took %.0f s and the save %.0f s, together more than trainer.stop_grace_s=%g: "
            "a stop signal during the updates would end the run without its save (exit 75 from the previous "
            "checkpoint); raise trainer.stop_grace_s and the job's --signal lead time",
            step,
            actor_s,
            save_s,
            self.grace_s,
        )


@dataclass
class TrainResult:
    """What a finished run reports."""

    run_dir: Path
    """The run folder."""
    steps: int
    """Rollout steps completed."""
    val_before: Optional[float]
    """Validation accuracy (avg@k) of the initial policy, when validated."""
    val_after: Optional[float]
    """Validation accuracy after the last step, when validated."""
    last_checkpoint: Optional[str]
    """The last checkpoint written."""
    already_complete: bool = False
    """The run was complete before this call (resumed at ``num_steps``): nothing ran."""
    seconds: float = 0.0
    """Wall-clock time of this call."""
    validations: list[tuple[int, float]] = field(default_factory=list)
    """Every validation of this call: ``(step, accuracy)``."""
    hf_export: Optional[Path] = None
    """The final policy as an HF checkpoint, when exported."""
    wandb: Optional[str] = None
    """Where the W&B run went, when logged there."""

    def summary(self, config: Config) -> list[str]:
        """The run's end, for the console: steps and time, validation first, best and
        last, and where everything went."""
        first = f"trained {self.steps} steps in {duration(self.seconds)}; run folder {self.run_dir}"
        if self.val_before is not None and self.val_after is not None:
            first += f"; validation accuracy {self.val_before:.1%} -> {self.val_after:.1%}"
        lines = [first]
        if self.validations:
            lines.append(f"validation accuracy: {validation_course(self.validations)}")
        lines.append(
            f"checkpoints: {config.checkpoint_save_dir}"
            + (f" (last: {Path(self.last_checkpoint).name})" if self.last_checkpoint else " (none written)")
            + (f"; HF export: {self.hf_export}" if self.hf_export is not None else "")
        )
        sinks = [f"metrics.jsonl {self.run_dir / 'metrics.jsonl'}"]
        if config.logging.tensorboard:
            sinks.append(
                f"TensorBoard {self.run_dir / 'tensorboard'} (tensorboard --logdir {self.run_dir / 'tensorboard'})"
            )
        if config.logging.rollout_records_every:
            sinks.append(f"rollout records {self.run_dir / RECORDS_DIR}")
        if self.wandb is not None:
            sinks.append(self.wandb)
        lines.append("wrote: " + "; ".join(sinks))
        return lines


def train(
    config: Config,
    inspect: Optional[Callable[[ActorGroup, RolloutWorkers], None]] = None,
    *,
    resume: bool = False,
    resume_from: Optional[str | Path] = None,
) -> TrainResult:
    """Run DAPO steps up to ``config.trainer.num_steps``; see the module docstring.

    ``resume`` / ``resume_from``: continue from the run's latest complete checkpoint, or
    from that one (:class:`~dapo_megatron.run.resume.RunCheckpoint`); a run already at
    ``num_steps`` is complete: nothing starts, and the result says so. ``inspect``, when
    given, is called with the actor and the engines after the last step, before they are
    shut down (tests compare the engines' weights with the actor's).
    """
    started = time.perf_counter()
    preflight(config)
    t, run_dir = config.trainer, Path(config.trainer.output_dir)
    checkpoints = RunCheckpoint(config, resume=resume, resume_from=resume_from)
    if checkpoints.complete:
        return TrainResult(run_dir, checkpoints.start_step, None, None, checkpoints.last, already_complete=True)
    reference = reference_weights(config)  # refused before anything starts
    tokenizer, train_data, val_data, loader = load_run_data(config)
    checkpoints.check_data(len(train_data.prompts), loader)
    make_run_folder(run_dir)
    with ExitStack() as stack:
        system = start_system(config, run_dir, stack)
        stepper = StepRunner(
            system,
            loader,
            training_sampling(config.rollout, tokenizer, engine_routing(config.model)),
            tokenizer,
            checkpoints.start_step,
        )
        checkpoints.restore(system.actor, stepper)
        if reference is not None:
            system.actor.load_reference(*reference)
        system.stop.check_starting()
        checkpoints.begin()  # the run has started: now its files change
        wandb = None
        if config.logging.wandb:
            wandb = WandbSink(run_dir, config.logging, config.to_dict(), resume=checkpoints.resumed_after is not None)
            stack.callback(wandb.close)
        metrics_log = stack.enter_context(
            MetricsLogger(run_dir, config.logging, t.num_steps, resume_after=checkpoints.resumed_after, sink=wandb)
        )
        records = stack.enter_context(
            RolloutRecorder(
                run_dir, config.logging, t.seed, resume_after=checkpoints.resumed_after, tokenizer=tokenizer
            )
        )
        system.sync_engines(checkpoints.start_step)  # the engines start from the actor's weights
        system.stop.running()
        validate = Validation(system, val_data, config, tokenizer, metrics_log, records)
        val_before = validate(0) if t.val_before_train and checkpoints.resumed_after is None else None
        bad_steps, stop_budget = BadStepCounter(t.max_bad_steps_in_a_row), StopBudget(t.stop_grace_s)
        for step in range(checkpoints.start_step + 1, t.num_steps + 1):
            # 1-6. Generate, score and filter; log-probs and updates; weight sync. A batch
            # generated ahead is part of a checkpoint's state: also generated at the last
            # step when it saves, so that a continued run is the same.
            due = checkpoints.due(step)
            try:
                metrics = stepper.step(step, generate_ahead=step < t.num_steps or due)
            except StopNow:  # the step's generation was abandoned: save the step before
                raise preempted(system.stop, checkpoints, stepper.version, abandoned=step) from None
            # 7. Metrics, checkpoint, validation. A failed generation ahead costs nothing
            # of this step: it is logged and saved first.
            failed = stepper.take_failure()
            metrics_log.log(step, metrics, histograms=stepper.histograms)
            records.record_step(step, stepper.rollouts)
            if wandb is not None and wandb.wants_table(step):
                wandb.table(step, step_rows(step, stepper.rollouts, 8, t.seed))
            bad_steps.record(step, metrics, checkpoints.last)
            if due or system.stop.signal_name is not None or failed is not None:
                checkpoints.save(step)
                stop_budget.check(step, metrics, checkpoints.last_save_s)
            if failed is not None and step < t.num_steps:
                raise GenerationAheadFailed(failed.step, failed.cause, checkpoint=checkpoints.last) from failed.cause
            if failed is not None:  # the last step's batch ahead was only for the checkpoint
                logger.warning("%s; training is complete and saved in %s", failed, checkpoints.last)
                stepper.sync()  # the engines serve the final weights for validation and export
            if t.val_every and step % t.val_every == 0 and step != t.num_steps:
                validate.unless_stopped(step)
            if system.stop.signal_name is not None:
                raise preempted(system.stop, checkpoints, step)
        val_after = validate(t.num_steps) if t.val_before_train or t.val_every else val_before
        exported = export_final_weights(config, checkpoints, run_dir)
        if inspect is not None:
            inspect(system.actor, system.engines)
    return TrainResult(
        run_dir,
        t.num_steps,
        val_before,
        val_after,
        checkpoints.last,
        seconds=time.perf_counter() - started,
        validations=validate.history,
        hf_export=exported,
        wandb=None if wandb is None else wandb.where(),
    )


def make_run_folder(run_dir: Path) -> None:
    """The run folder (refused, naming ``trainer.output_dir``, when it cannot be made)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"trainer.output_dir={str(run_dir)!r}: cannot create the run folder: {exc}") from None


def preempted(stop: StopRequest, checkpoints: RunCheckpoint, step: int, abandoned: Optional[int] = None) -> Preempted:
    """After a stop signal: the checkpoint of ``step`` (the last completed one; after an
    abandoned generation, with the data position from before that step drew its prompts,
    which a checkpoint of ``step``, when there is one, already holds: not rewritten),
    and the exception that ends the run with it."""
    checkpoint = checkpoints.ensure(step)
    stop.saved()
    return Preempted(stop.signal_name, step, checkpoint, abandoned=abandoned)


def export_final_weights(config: Config, checkpoints: RunCheckpoint, run_dir: Path) -> Optional[Path]:
    """``checkpoint.export_hf``: the last step's weights as an HF model in ``hf_final``
    (its folder; None when not exported)."""
    if config.checkpoint.export_hf and config.model.hf_config is None:
        logger.warning("checkpoint.export_hf: no model.hf_config (config.json) to export with; skipped")
    elif config.checkpoint.export_hf:
        export_hf(checkpoints.ensure(config.trainer.num_steps), config, run_dir / "hf_final")
        return run_dir / "hf_final"
    return None
