"""The DAPO trainer: one module that reads top to bottom as a step of DAPO does.

A step (``docs/design.md``): take prompts; generate ``n`` responses each on the
rollout engines; score them (rule-based reward plus the soft overlong punishment);
dynamic sampling keeps groups whose answers disagree and draws more rounds until
``train_batch_size`` groups are kept; advantages by prompt identity; old log-probs from
the actor; ``train_batch_size * n / mini_batch_size`` DAPO updates; weight sync into
every engine; metrics; a checkpoint every ``checkpoint.save_every`` steps.

Steps 1-6 of a step are :class:`dapo_megatron.run.step.Stepper` (shared with ``bench``);
this module runs the steps and what surrounds them: data, resume, validation,
checkpoints, preemption, the bad-step stop and the final export. Where work runs is
hidden behind three objects: ``actor`` (the Megatron ranks), ``engines`` (the rollout
engines) and ``rewards`` (a process pool); the trainer never touches a Ray handle.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dapo_megatron.actor.checkpoint import checkpoint_dir, list_checkpoints, point_latest_at
from dapo_megatron.ckpt.convert import export_hf
from dapo_megatron.ckpt.dcp_io import LATEST, checkpoint_problem, latest_checkpoint
from dapo_megatron.config import Config, ConfigError, checkpoint_save_dir, source_of
from dapo_megatron.orchestration.actor_group import ActorGroup
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.run.evaluation import evaluate_policy
from dapo_megatron.run.metrics_log import MetricsLogger
from dapo_megatron.run.preflight import preflight
from dapo_megatron.run.step import (
    GenerationAheadFailed,
    Stepper,
    StopNow,
    load_initial_weights,
    load_run_data,
    reference_weights,
    start_system,
    training_sampling,
)
from dapo_megatron.sampling.samples import load_samples, save_samples

logger = logging.getLogger(__name__)


class Preempted(Exception):
    """The run was asked to stop by a signal and saved a checkpoint of its last completed
    step (``abandoned``: the step whose generation was in flight, and abandoned)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str, abandoned: Optional[int] = None) -> None:
        during = f" (step {abandoned}'s generation abandoned: it runs whole after --resume)" if abandoned else ""
        super().__init__(
            f"stopped by {signal_name} after step {step}{during}; checkpoint {checkpoint}; continue with --resume"
        )
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


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


def train(
    config: Config,
    inspect: Optional[Callable[[ActorGroup, RolloutWorkers], None]] = None,
    *,
    resume: bool = False,
    resume_from: Optional[str | Path] = None,
) -> TrainResult:
    """Run DAPO steps up to ``config.trainer.num_steps``; see the module docstring.

    ``resume``: continue from the latest complete checkpoint of ``checkpoint.load_dir``,
    else of the run's checkpoint folder: the actor's whole state (any tp/pp layout) and
    the trainer's (step, data position), so the continued run takes the same steps an
    uninterrupted one would. ``resume_from``: continue from that checkpoint instead (one
    before a damaged latest one); later checkpoints of the run are moved aside. A run
    whose checkpoint is already at ``num_steps`` is complete: nothing starts, and the
    result says so. A run folder whose earlier attempt left no checkpoint (it failed or
    was stopped before its first save) is reused, its files kept aside. ``inspect``, when
    given, is called with the actor and the engines after the last step, before they are
    shut down (tests compare the engines' weights with the actor's).
    """
    preflight(config)
    run_dir = Path(config.trainer.output_dir)
    save_dir = str(checkpoint_save_dir(config))
    point = _resume_point(config, save_dir, resume_from) if resume or resume_from is not None else None
    start_step = point[1]["step"] if point else 0
    if point is not None and start_step >= config.trainer.num_steps:
        logger.info("%s is at step %d of %d: the run is complete", point[0], start_step, config.trainer.num_steps)
        return TrainResult(run_dir, start_step, None, None, str(point[0]), already_complete=True)
    if point is None:
        _refuse_a_save_dir_with_checkpoints(config, save_dir)
    earlier_attempt = point is None and _earlier_attempt(run_dir)
    reference = reference_weights(config)  # refused before anything starts
    tokenizer, train_data, val_data, loader = load_run_data(config)
    if point is not None:
        _check_resumable(point, config, len(train_data.prompts))
        loader.load_state_dict(point[1]["data"])
    sampling = training_sampling(config, tokenizer)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"trainer.output_dir={str(run_dir)!r}: cannot create the run folder: {exc}") from None

    with ExitStack() as stack:
        system = start_system(config, run_dir, stack)
        actor, engines, rewards, stop = system.actor, system.engines, system.rewards, system.stop
        if point is not None:
            restored = actor.load_checkpoint(str(point[0]), config.trainer.seed)
            if restored != start_step:
                raise ConfigError(f"{point[0]}: the actor is at step {restored}, its trainer state at {start_step}")
            logger.info("resumed from %s: continuing after step %d", point[0], start_step)
        else:
            load_initial_weights(actor, config)
        if reference is not None:
            actor.load_reference(*reference)
        stop.check_starting()
        # The run has started: now its files change (a run refused above leaves none).
        if earlier_attempt:
            _set_earlier_attempt_aside(run_dir)
        if resume_from is not None:
            _supersede_later_checkpoints(save_dir, point[0], start_step)
        config_name = f"config.resumed_at_step_{start_step}.yaml" if point else "config.yaml"
        (run_dir / config_name).write_text(config.to_yaml())
        metrics_log = MetricsLogger(
            run_dir, config.logging, config.trainer.num_steps, resume_after=start_step if point else None
        )
        stack.callback(metrics_log.close)
        # The engines start from the actor's weights: both sides hold the same policy.
        system.sync_engines(start_step)
        stop.running()

        def validate(step: int) -> Optional[float]:
            if val_data is None:
                return None
            values, _ = evaluate_policy(engines, rewards, val_data.prompts, config, tokenizer)
            metrics_log.log(step, values, console=True)
            return values["val/accuracy"]

        val_before = validate(0) if config.trainer.val_before_train and point is None else None
        last_checkpoint = str(point[0]) if point else None

        def save(step: int) -> str:
            """The actor's checkpoint of ``step``, with the trainer's state inside it, and
            the batch generated ahead (async) written once by the driver, in binary."""
            kept, moved = stepper.checkpoint_state(), {}
            if kept.ahead is not None:
                partial = Path(save_dir) / f".{GENERATED_AHEAD}.step_{step}.partial"
                partial.parent.mkdir(parents=True, exist_ok=True)
                samples, rollout_metrics, times = kept.ahead
                save_samples(partial, samples, {"metrics": rollout_metrics, "times": times})
                moved[GENERATED_AHEAD] = str(partial)
            if kept.stream is not None:  # carried groups and partial responses
                partial = Path(save_dir) / f".{STREAM_STATE}.step_{step}.partial"
                partial.parent.mkdir(parents=True, exist_ok=True)
                torch.save(kept.stream, partial)
                moved[STREAM_STATE] = str(partial)
            state = _trainer_state(
                step,
                kept.data,
                config,
                len(train_data.prompts),
                GENERATED_AHEAD if GENERATED_AHEAD in moved else None,
                STREAM_STATE if STREAM_STATE in moved else None,
            )
            try:
                return actor.save(save_dir, config.checkpoint.keep_last, {TRAINER_STATE: state}, moved)
            finally:
                for path in moved.values():
                    Path(path).unlink(missing_ok=True)  # moved in by a successful save

        val_after = val_before
        bad_steps = BadStepCounter(config.trainer.max_bad_steps_in_a_row)
        stop_budget = StopBudget(config.trainer.stop_grace_s)
        stepper = Stepper(system, loader, sampling, tokenizer, version=start_step)
        stack.callback(stepper.close)
        ahead_file = point[1].get("generated_ahead") if point is not None else None
        if ahead_file is not None and not isinstance(ahead_file, str):
            raise ConfigError(
                f"{point[0]}: its batch generated ahead is in the JSON format of an earlier version; resume it "
                "with that version, or start a new run from its weights (checkpoint.load_dir, without --resume)"
            )
        if ahead_file:
            samples, extra = load_samples(point[0] / ahead_file)
            stepper.load_state_dict((samples, extra["metrics"], extra["times"]))
        stream_file = point[1].get("stream_state") if point is not None else None
        if stream_file and stepper.stream is not None:
            stepper.stream.load_state_dict(torch.load(point[0] / stream_file, weights_only=True))
        for step in range(start_step + 1, config.trainer.num_steps + 1):
            due = config.checkpoint.save_every and (
                step % config.checkpoint.save_every == 0 or step == config.trainer.num_steps
            )
            # 1-6. Generate, score and filter; log-probs and updates; weight sync. A
            # batch generated ahead is part of a checkpoint's state: generate the next one
            # also at the last step when it saves, so that a continued run is the same.
            try:
                step_metrics = stepper.step(step, generate_ahead=step < config.trainer.num_steps or bool(due))
            except StopNow:
                # The step's generation was abandoned: the checkpoint is of the step before,
                # with the data position from before this one drew its prompts (which a
                # checkpoint of that step, when there is one, already holds: not rewritten).
                if last_checkpoint is None or Path(last_checkpoint) != checkpoint_dir(save_dir, stepper.version):
                    last_checkpoint = save(stepper.version)
                stop.saved()
                raise Preempted(stop.signal_name, stepper.version, last_checkpoint, abandoned=step) from None

            # 7. Metrics, checkpoint, validation. A failed generation ahead costs nothing
            # of this step: it is logged and saved first.
            failed = stepper.take_failure()
            metrics_log.log(step, step_metrics)
            for name, values in stepper.histograms.items():
                metrics_log.log_histogram(step, name, values)
            bad_steps.record(step, step_metrics, last_checkpoint)
            if due or stop.signal_name is not None or failed is not None:
                saving = time.perf_counter()
                last_checkpoint = save(step)
                stop_budget.check(step, step_metrics, time.perf_counter() - saving)
            if failed is not None and step < config.trainer.num_steps:
                raise GenerationAheadFailed(failed.step, failed.cause, checkpoint=last_checkpoint) from failed.cause
            if failed is not None:
                # The last step's batch ahead was only for the checkpoint: training is done.
                logger.warning("%s; training is complete and saved in %s", failed, last_checkpoint)
                stepper.sync()  # the engines serve the final weights for validation and export
            if config.trainer.val_every and step % config.trainer.val_every == 0 and step != config.trainer.num_steps:
                try:
                    with stop.abortable():  # a stop abandons validation, as it does generation
                        validate(step)
                except StopNow:
                    pass
            if stop.signal_name is not None:
                if last_checkpoint is None or Path(last_checkpoint) != checkpoint_dir(save_dir, step):
                    last_checkpoint = save(step)  # the signal came after the step's own save
                stop.saved()
                raise Preempted(stop.signal_name, step, last_checkpoint)
        if config.trainer.val_before_train or config.trainer.val_every:
            val_after = validate(config.trainer.num_steps)
        if config.checkpoint.export_hf and config.model.hf_config is None:
            logger.warning("checkpoint.export_hf: no model.hf_config (config.json) to export with; skipped")
        elif config.checkpoint.export_hf:
            final = checkpoint_dir(save_dir, config.trainer.num_steps)
            if last_checkpoint is None or Path(last_checkpoint) != final:
                last_checkpoint = save(config.trainer.num_steps)
            export_hf(last_checkpoint, config, run_dir / "hf_final")
        if inspect is not None:
            inspect(actor, engines)
    return TrainResult(run_dir, config.trainer.num_steps, val_before, val_after, last_checkpoint)


TRAINER_STATE = "trainer_state.json"
"""The trainer's own state, inside each actor checkpoint (written before it is published)."""

STREAM_STATE = "stream_state.pt"
"""Streamed generation: the groups carried over and the partial responses in flight, in
each checkpoint of a run that streams (see :class:`dapo_megatron.sampling.streaming.StreamingSampler`)."""

GENERATED_AHEAD = "generated_ahead.pt"
"""Async generation: the next step's batch, in each checkpoint that has one (binary,
written once by the driver; see :func:`dapo_megatron.sampling.samples.save_samples`)."""

RESUME_KEYS = (
    "data.seed",
    "data.shuffle",
    "data.train_batch_size",
    "data.gen_batch_size",
    "rollout.n_samples_per_prompt",
    "rollout.streaming",
    "rollout.carry_over",
    "rollout.partial_rollout",
    "rollout.max_prompts_in_flight",
    "rollout.stream_chunk_tokens",
    "rollout.max_staleness",
)
"""Settings the saved data position and batches depend on: a resume must keep them."""


def _setting(config: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _trainer_state(
    step: int, data: dict, config: Config, num_prompts: int, ahead: Optional[str], stream: Optional[str]
) -> str:
    """What a resumed run needs besides the actor: the step, the data position, what the
    rollout seeds derive from and the settings the data position depends on, and (async
    generation) the name of the file that holds the next step's batch, generated during
    this one with weights the checkpoint no longer holds, and (streamed generation) of the
    file that holds the groups carried over and the partial responses in flight.
    Generation seeds are a function of (rollout.seed, step, round, prompt, sample), and
    otherwise dynamic sampling drops its surplus at the end of every step, so no sampler
    state or other leftover samples need saving."""
    return json.dumps(
        {
            "step": step,
            "data": data,
            "num_prompts": num_prompts,
            "rollout_seed": config.rollout.seed,
            "settings": {key: _setting(config, key) for key in RESUME_KEYS},
            "metrics_step": step,
            "generated_ahead": ahead,
            "stream_state": stream,
        },
        indent=1,
    )


def _read_trainer_state(path: Path) -> dict:
    """The trainer state inside checkpoint ``path``; a missing or damaged file is refused,
    naming it (and the previous complete checkpoint of its folder, when there is one)."""
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise ConfigError(
            f"{path} has no {TRAINER_STATE}: it was not written by `dapo-megatron train`, so there is no data "
            f"position to resume; to start a new run from its weights, set checkpoint.load_dir={path} without --resume"
        )
    try:
        state = json.loads(state_file.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no step in it")
    except ValueError as exc:  # JSONDecodeError included
        raise ConfigError(f"{state_file} is damaged ({exc}){_previous_complete(path.parent, path)}") from None
    return state


def _checked(path: Path) -> tuple[Path, dict]:
    """``(path, trainer state)`` of a checkpoint whose files are all there in full."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"cannot resume from {path}: {problem}{_previous_complete(path.parent, path)}")
    return path, _read_trainer_state(path)


def _previous_complete(save_dir: Path, damaged: Optional[Path]) -> str:
    """``"; the previous complete checkpoint is ..."``: the newest checkpoint of ``save_dir``
    other than ``damaged`` whose files and trainer state are whole, and how to continue."""
    for candidate in reversed(list_checkpoints(save_dir)):
        if damaged is not None and candidate.resolve() == damaged.resolve():
            continue
        if checkpoint_problem(candidate) is not None:
            continue
        try:
            step = json.loads((candidate / TRAINER_STATE).read_text())["step"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return (
            f"; the previous complete checkpoint is {candidate} (step {step}): continue from it with "
            f"`--resume-from {candidate}` (the damaged one is kept, moved aside)"
        )
    return f"; {save_dir} holds no other complete checkpoint"


def _resume_point(config: Config, save_dir: str, explicit: Optional[str | Path] = None) -> tuple[Path, dict]:
    """The checkpoint to resume from and its trainer state: ``explicit`` when given, else
    the latest complete checkpoint of the run's checkpoint folder, else of
    ``checkpoint.load_dir``. A damaged one is refused naming the bad file and offering
    the previous complete checkpoint."""
    if explicit is not None:
        if not Path(explicit).is_dir():
            raise ConfigError(f"--resume-from {explicit}: no such checkpoint folder")
        return _checked(Path(explicit))
    sources = [("the run's checkpoint folder", save_dir)]
    if config.checkpoint.load_dir:
        sources.append(("checkpoint.load_dir", config.checkpoint.load_dir))
    path = None
    for key, source in sources:
        try:
            path = latest_checkpoint(source)
        except FileNotFoundError as exc:
            raise ConfigError(
                f"cannot resume from {key} {source}: {exc}{_previous_complete(Path(source), None)}"
            ) from None
        if path is not None:
            break
    if path is None:
        where = " or ".join(f"{key} {source}" for key, source in sources)
        raise ConfigError(
            f"nothing to resume: no checkpoint in {where}; start the run without --resume (a run folder "
            "without checkpoints is reused, its earlier files kept aside)"
        )
    return _checked(path)


def _refuse_a_save_dir_with_checkpoints(config: Config, save_dir: str) -> None:
    """A run started without resume writes its checkpoints from step 1 on: into a folder
    that holds checkpoints (another run's, or this run's from an earlier attempt) it
    would replace theirs of the same steps and move ``latest`` backwards. Refused, naming
    the folder, before anything is touched."""
    found = [p.name for p in list_checkpoints(save_dir)]
    if (Path(save_dir) / LATEST).exists():
        found.append(LATEST)
    if not found:
        return
    key = "checkpoint.save_dir" if config.checkpoint.save_dir else "trainer.output_dir (its checkpoints/ folder)"
    shown = ", ".join(found if len(found) <= 4 else [found[0], "...", *found[-2:]])
    raise ConfigError(
        f"{source_of(config, key.split()[0])}: {key}: {save_dir} already holds checkpoints ({shown}); a run "
        "started without --resume would overwrite them. Pass --resume to continue the run they belong to, or "
        "choose another checkpoint.save_dir (nothing in it was touched)"
    )


def _earlier_attempt(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds an earlier attempt (its save folder holds no checkpoint:
    see :func:`_refuse_a_save_dir_with_checkpoints`); it is reused, its files set aside
    when the run starts."""
    earlier = run_dir / "metrics.jsonl"
    return earlier.exists() and earlier.stat().st_size > 0


EARLIER_ATTEMPT_FILES = ("metrics.jsonl", "tensorboard", "config.yaml")
"""What an earlier attempt without checkpoints leaves in a run folder, set aside on reuse."""


def _set_earlier_attempt_aside(run_dir: Path) -> None:
    aside = run_dir / f"earlier-attempt-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for name in EARLIER_ATTEMPT_FILES:
        if (run_dir / name).exists():
            shutil.move(str(run_dir / name), str(aside / name))
    logger.warning(
        "%s held an earlier attempt that stopped before its first checkpoint; its files are in %s, and the run "
        "starts again from step 0",
        run_dir,
        aside,
    )


def _supersede_later_checkpoints(save_dir: str, resumed: Path, step: int) -> None:
    """After ``--resume-from`` an earlier checkpoint of the run: the later ones (and the
    damaged one) are moved into ``superseded-<time>/`` of the save folder (kept, and out
    of ``keep_last``'s count), and ``latest`` names the resumed one."""
    later = [p for p in list_checkpoints(save_dir) if p.name > checkpoint_dir(save_dir, step).name]
    if later:
        aside = Path(save_dir) / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for folder in later:
            shutil.move(str(folder), str(aside / folder.name))
        logger.warning(
            "resumed from step %d: the later checkpoints %s were moved to %s", step, [p.name for p in later], aside
        )
    if Path(save_dir).resolve() == resumed.parent.resolve():
        point_latest_at(save_dir, resumed, step)


def _check_resumable(resume_from: tuple[Path, dict], config: Config, num_prompts: int) -> None:
    """Refuse a resume whose data no longer matches the saved position; warn when the
    rollout seed changed (the run continues, but not as the uninterrupted one would)."""
    path, state = resume_from
    if state["num_prompts"] != num_prompts:
        raise ConfigError(
            f"{path}: the run was saved with {state['num_prompts']} training prompts but data.train_files now hold "
            f"{num_prompts}; its data position would be meaningless. Resume with the same data.train_files"
        )
    changed = [
        f"{key}={_setting(config, key)!r} (saved with {saved!r})"
        for key, saved in state.get("settings", {}).items()
        if _setting(config, key) != saved
    ]
    if changed:
        raise ConfigError(
            f"{path}: " + ", ".join(changed) + ": the saved data position and batches depend on these settings, so "
            "the resumed run would not continue the saved one; resume with the saved values (or start a new run "
            "from this checkpoint's weights with checkpoint.load_dir and without --resume)"
        )
    if state["rollout_seed"] != config.rollout.seed:
        logger.warning(
            "rollout.seed is %d, the run was saved with %d: the resumed steps sample differently from an "
            "uninterrupted run",
            config.rollout.seed,
            state["rollout_seed"],
        )
