"""The DAPO trainer: one module that reads top to bottom as a step of DAPO does.

A step (``docs/design.md``): take prompts; generate ``n`` responses each on the
rollout engines; score them (rule-based reward plus the soft overlong punishment);
dynamic sampling keeps groups whose answers disagree and draws more rounds until
``train_batch_size`` groups are kept; advantages by prompt identity; old log-probs from
the actor; ``train_batch_size * n / mini_batch_size`` DAPO updates; weight sync into
every engine; metrics; a checkpoint every ``checkpoint.save_every`` steps.

Steps 1-6 of a step are :class:`dapo_megatron.step.Stepper` (shared with ``bench``);
this module runs the steps and what surrounds them: data, resume, validation,
checkpoints, preemption, the bad-step stop and the final export. Where work runs is
hidden behind three objects: ``actor`` (the Megatron ranks), ``engines`` (the rollout
engines) and ``rewards`` (a process pool); the trainer never touches a Ray handle.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dapo_megatron.actor.checkpoint import checkpoint_dir
from dapo_megatron.algo.rewards.pool import RewardPool
from dapo_megatron.config import Config, ConfigError, checkpoint_save_dir, hf_weights_folder
from dapo_megatron.data import PromptDataset, PromptLoader, load_tokenizer, validation_dataset
from dapo_megatron.experience import Sample, load_samples, save_samples, validation_metrics
from dapo_megatron.orchestration.actor_group import ActorGroup
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.step import GenerationAheadFailed, Stepper, generate_and_score, start_system, training_sampling
from dapo_megatron.tracking import MetricsLogger

logger = logging.getLogger(__name__)


class Preempted(Exception):
    """The run was asked to stop by a signal; it finished its step and saved a checkpoint."""

    def __init__(self, signal_name: str, step: int, checkpoint: str) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {checkpoint}; continue with --resume")
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


def train(
    config: Config,
    inspect: Optional[Callable[[ActorGroup, RolloutWorkers], None]] = None,
    *,
    resume: bool = False,
) -> TrainResult:
    """Run DAPO steps up to ``config.trainer.num_steps``; see the module docstring.

    ``resume``: continue from the latest complete checkpoint of ``checkpoint.load_dir``,
    else of the run's checkpoint folder: the actor's whole state (any tp/pp layout) and
    the trainer's (step, data position), so the continued run takes the same steps an
    uninterrupted one would. ``inspect``, when given, is called with the actor and the
    engines after the last step, before they are shut down (tests compare the engines'
    weights with the actor's).
    """
    run_dir = Path(config.trainer.output_dir)
    save_dir = str(checkpoint_save_dir(config))
    resume_from = _resume_point(config, save_dir) if resume else None
    earlier = run_dir / "metrics.jsonl"
    if resume_from is None and earlier.exists() and earlier.stat().st_size:
        raise ConfigError(
            f"trainer.output_dir={str(run_dir)!r} already holds a run (metrics.jsonl); pass --resume to continue "
            "it, or choose another trainer.output_dir (nothing in it is touched)"
        )
    start_step = resume_from[1]["step"] if resume_from else 0
    reference = reference_weights(config)  # refused before anything starts
    run_dir.mkdir(parents=True, exist_ok=True)
    config_name = f"config.resumed_at_step_{start_step}.yaml" if resume_from else "config.yaml"
    (run_dir / config_name).write_text(config.to_yaml())
    tokenizer, train_data, val_data, loader = load_run_data(config)
    if resume_from is not None:
        _check_resumable(resume_from, config, len(train_data.prompts))
        loader.load_state_dict(resume_from[1]["data"])
    sampling = training_sampling(config, tokenizer)

    with ExitStack() as stack:
        system = start_system(config, run_dir, stack)
        actor, engines, rewards, stop = system.actor, system.engines, system.rewards, system.stop
        metrics_log = MetricsLogger(
            run_dir, config.logging, config.trainer.num_steps, resume_after=start_step if resume_from else None
        )
        stack.callback(metrics_log.close)

        if resume_from is not None:
            restored = actor.load_checkpoint(str(resume_from[0]), config.trainer.seed)
            if restored != start_step:
                raise ConfigError(
                    f"{resume_from[0]}: the actor is at step {restored}, its trainer state at {start_step}"
                )
            logger.info("resumed from %s: continuing after step %d", resume_from[0], start_step)
        else:
            load_initial_weights(actor, config)
        if reference is not None:
            actor.load_reference(*reference)
        # The engines start from the actor's weights: both sides hold the same policy.
        system.sync_engines(start_step)

        def validate(step: int) -> Optional[float]:
            if val_data is None:
                return None
            values, _ = evaluate_policy(engines, rewards, val_data.prompts, config, tokenizer)
            metrics_log.log(step, values, console=True)
            return values["val/accuracy"]

        val_before = validate(0) if config.trainer.val_before_train and resume_from is None else None
        last_checkpoint = str(resume_from[0]) if resume_from else None

        def save(step: int) -> str:
            """The actor's checkpoint of ``step``, with the trainer's state inside it, and
            the batch generated ahead (async) written once by the driver, in binary."""
            ahead, moved = stepper.state_dict(), {}
            if ahead is not None:
                partial = Path(save_dir) / f".{GENERATED_AHEAD}.step_{step}.partial"
                partial.parent.mkdir(parents=True, exist_ok=True)
                samples, rollout_metrics, times = ahead
                save_samples(partial, samples, {"metrics": rollout_metrics, "times": times})
                moved[GENERATED_AHEAD] = str(partial)
            state = _trainer_state(step, loader, config, len(train_data.prompts), GENERATED_AHEAD if moved else None)
            try:
                return actor.save(save_dir, config.checkpoint.keep_last, {TRAINER_STATE: state}, moved)
            finally:
                for path in moved.values():
                    Path(path).unlink(missing_ok=True)  # moved in by a successful save

        val_after = val_before
        bad_steps = BadStepCounter(config.trainer.max_bad_steps_in_a_row)
        stepper = Stepper(system, loader, sampling, tokenizer, version=start_step)
        stack.callback(stepper.close)
        ahead_file = resume_from[1].get("generated_ahead") if resume_from is not None else None
        if ahead_file is not None and not isinstance(ahead_file, str):
            raise ConfigError(
                f"{resume_from[0]}: its batch generated ahead is in the JSON format of an earlier version; resume it "
                "with that version, or start a new run from its weights (checkpoint.load_dir, without --resume)"
            )
        if ahead_file:
            samples, extra = load_samples(resume_from[0] / ahead_file)
            stepper.load_state_dict((samples, extra["metrics"], extra["times"]))
        for step in range(start_step + 1, config.trainer.num_steps + 1):
            due = config.checkpoint.save_every and (
                step % config.checkpoint.save_every == 0 or step == config.trainer.num_steps
            )
            # 1-6. Generate, score and filter; log-probs and updates; weight sync. A
            # batch generated ahead is part of a checkpoint's state: generate the next one
            # also at the last step when it saves, so that a continued run is the same.
            step_metrics = stepper.step(step, generate_ahead=step < config.trainer.num_steps or bool(due))

            # 7. Metrics, checkpoint, validation. A failed generation ahead costs nothing
            # of this step: it is logged and saved first.
            failed = stepper.take_failure()
            metrics_log.log(step, step_metrics)
            bad_steps.record(step, step_metrics, last_checkpoint)
            if due or stop.signal_name is not None or failed is not None:
                last_checkpoint = save(step)
            if failed is not None and step < config.trainer.num_steps:
                raise GenerationAheadFailed(failed.step, failed.cause, checkpoint=last_checkpoint) from failed.cause
            if failed is not None:
                # The last step's batch ahead was only for the checkpoint: training is done.
                logger.warning("%s; training is complete and saved in %s", failed, last_checkpoint)
                stepper.sync()  # the engines serve the final weights for validation and export
            if stop.signal_name is not None:
                raise Preempted(stop.signal_name, step, last_checkpoint)
            if config.trainer.val_every and step % config.trainer.val_every == 0 and step != config.trainer.num_steps:
                validate(step)
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


def load_run_data(config: Config) -> tuple:
    """The tokenizer, the training and validation prompts, and the training loader at
    its start: ``(tokenizer, train_data, val_data or None, loader)``."""
    r, d = config.rollout, config.data
    tokenizer = load_tokenizer(d, hf_weights_folder(config.model))
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer of data.tokenizer={d.tokenizer!r} has no EOS token to stop responses on")
    train_data = PromptDataset(d.train_files, tokenizer, d, r.max_prompt_length)
    val_data = validation_dataset(d.val_files, tokenizer, d, r.max_prompt_length) if d.val_files else None
    return tokenizer, train_data, val_data, PromptLoader(train_data, seed=d.seed, shuffle=d.shuffle)


def validation_sampling(config: Config, tokenizer) -> SamplingParams:
    """``rollout.val_*``: the sampling of validation and ``eval`` (seeded: repeatable)."""
    r = config.rollout
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
        engines, rewards, prompts, validation_sampling(config, tokenizer), n, -1, config, tokenizer, {}
    )
    return {**validation_metrics(samples, n), "time/validate": time.perf_counter() - start}, samples


def initial_weights(config: Config) -> Optional[tuple[str, str]]:
    """Where a run's initial weights come from, as ``(source, path)``: a converted Megatron
    checkpoint (``checkpoint.load_dir``: ``megatron``), else the HF folder's safetensors
    (``hf``, converted on load); None for the random initialisation."""
    from dapo_megatron.ckpt.dcp_io import latest_checkpoint

    load_dir = config.checkpoint.load_dir
    if load_dir is not None:
        path = latest_checkpoint(load_dir) or Path(load_dir)
        if not Path(path).exists():
            raise ConfigError(f"checkpoint.load_dir={load_dir!r} does not exist")
        return "megatron", str(path)
    folder = hf_weights_folder(config.model)
    if folder is not None and any(folder.glob("*.safetensors")):
        return "hf", str(folder)
    if config.model.hf_weights is not None:
        raise ConfigError(
            f"model.hf_weights={config.model.hf_weights!r} holds no *.safetensors files; point it at an HF model "
            f"folder (for the demo, run `make demo` or examples/demo/prepare.py first)"
        )
    return None


def load_initial_weights(actor: ActorGroup, config: Config) -> None:
    """The run's :func:`initial_weights` into the actor, else the random initialisation
    (with a warning)."""
    initial = initial_weights(config)
    if initial is None:
        logger.warning(
            "no checkpoint.load_dir and no safetensors next to model.hf_config: training from random weights"
        )
        return
    source, path = initial
    kind = "Megatron checkpoint" if source == "megatron" else "HF checkpoint (converted on load)"
    logger.info("initial weights from the %s %s", kind, path)
    actor.load_weights(source, path)


def reference_weights(config: Config) -> Optional[tuple[str, str]]:
    """With ``algorithm.use_kl_loss``: the reference policy's weights, the run's initial
    ones (also on resume); refused when the run has none to hold (random initialisation)."""
    if not config.algorithm.use_kl_loss:
        return None
    initial = initial_weights(config)
    if initial is None:
        raise ConfigError(
            "algorithm.use_kl_loss: the KL penalty's reference policy is the run's initial weights, and this run has "
            "none (no checkpoint.load_dir, no safetensors in model.hf_weights); give it initial weights or turn the "
            "penalty off"
        )
    return initial


def export_hf(checkpoint: str | Path, config: Config, out: Path) -> None:
    """A Megatron checkpoint as HF safetensors, verified as ``convert`` verifies, with
    config.json from ``model.hf_config`` and the tokenizer files copied (the final policy
    of a run; ``eval --ckpt``)."""
    from dapo_megatron.ckpt.convert import copy_tokenizer_files, megatron_to_hf, silenced

    if config.model.hf_config is None:
        raise ConfigError("exporting a checkpoint to HF needs model.hf_config (the model's config.json)")
    with silenced(True):  # the verification's library warnings; errors still raise
        report = megatron_to_hf(checkpoint, config.model.hf_config, out, overwrite=True, progress=False)
    tokenizer_dir = config.data.tokenizer or hf_weights_folder(config.model)
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), out)
    checked = f"verified (max relative logit error {report.max_logit_error:.1e})" if report.verified else "not verified"
    logger.info("%s exported to %s (%s)", checkpoint, out, checked)


TRAINER_STATE = "trainer_state.json"
"""The trainer's own state, inside each actor checkpoint (written before it is published)."""

GENERATED_AHEAD = "generated_ahead.pt"
"""Async generation: the next step's batch, in each checkpoint that has one (binary,
written once by the driver; see :func:`dapo_megatron.experience.save_samples`)."""

RESUME_KEYS = (
    "data.seed",
    "data.shuffle",
    "data.train_batch_size",
    "data.gen_batch_size",
    "rollout.n_samples_per_prompt",
)
"""Settings the saved data position and batches depend on: a resume must keep them."""


def _setting(config: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _trainer_state(step: int, loader: PromptLoader, config: Config, num_prompts: int, ahead: Optional[str]) -> str:
    """What a resumed run needs besides the actor: the step, the data position, what the
    rollout seeds derive from and the settings the data position depends on, and (async
    generation) the name of the file that holds the next step's batch, generated during
    this one with weights the checkpoint no longer holds. Generation seeds are a function
    of (rollout.seed, step, round, prompt, sample), and dynamic sampling drops its surplus
    at the end of every step, so no sampler state or other leftover samples need saving."""
    return json.dumps(
        {
            "step": step,
            "data": loader.state_dict(),
            "num_prompts": num_prompts,
            "rollout_seed": config.rollout.seed,
            "settings": {key: _setting(config, key) for key in RESUME_KEYS},
            "metrics_step": step,
            "generated_ahead": ahead,
        },
        indent=1,
    )


def _resume_point(config: Config, save_dir: str) -> tuple[Path, dict]:
    """The latest complete checkpoint to resume from and its trainer state: the run's own
    checkpoint folder first, else ``checkpoint.load_dir``."""
    from dapo_megatron.ckpt.dcp_io import latest_checkpoint

    sources = [("the run's checkpoint folder", save_dir)]
    if config.checkpoint.load_dir:
        sources.append(("checkpoint.load_dir", config.checkpoint.load_dir))
    path = None
    for key, source in sources:
        try:
            path = latest_checkpoint(source)
        except FileNotFoundError as exc:
            raise ConfigError(f"cannot resume from {key} {source}: {exc}") from None
        if path is not None:
            break
    if path is None:
        where = " or ".join(f"{key} {source}" for key, source in sources)
        raise ConfigError(
            f"nothing to resume: no checkpoint in {where}; start the run without --resume "
            f"(checkpoints are written every checkpoint.save_every steps)"
        )
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise ConfigError(
            f"{path} has no {TRAINER_STATE}: it was not written by `dapo-megatron train`, so there is no data "
            f"position to resume; to start a new run from its weights, set checkpoint.load_dir={path} without --resume"
        )
    return path, json.loads(state_file.read_text())


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
