"""The DAPO trainer: one module that reads top to bottom as a step of DAPO does.

A step (``../shared/DESIGN.md``): take prompts; generate ``n`` responses each on the
rollout engines; score them (rule-based reward plus the soft overlong punishment);
dynamic sampling keeps groups whose answers disagree and draws more rounds until
``train_batch_size`` groups are kept; advantages by prompt identity; old log-probs from
the actor; ``train_batch_size * n / mini_batch_size`` DAPO updates; weight sync into
every engine; metrics; a checkpoint every ``checkpoint.save_every`` steps.

Where work runs is hidden behind three objects: ``actor`` (the Megatron ranks),
``engines`` (the rollout engines) and ``rewards`` (a process pool). The trainer times the
calls and gathers metrics around them; it never touches a Ray handle.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from dapo_megatron.actor.batch import PolicyBatch
from dapo_megatron.actor.checkpoint import checkpoint_dir
from dapo_megatron.algo import DynamicSamplingAccumulator
from dapo_megatron.algo.metrics import rollout_consistency
from dapo_megatron.algo.rewards.pool import RewardPool
from dapo_megatron.algo.rollout_correction import correction_weights, mismatch_metrics
from dapo_megatron.config import Config, ConfigError, checkpoint_save_dir, hf_weights_folder
from dapo_megatron.data import PromptDataset, PromptLoader, load_tokenizer, validation_dataset
from dapo_megatron.experience import (
    Sample,
    apply_rewards,
    build_policy_batch,
    engine_log_prob_grid,
    response_metrics,
    samples_from_generations,
    validation_metrics,
)
from dapo_megatron.orchestration.actor_group import ActorGroup
from dapo_megatron.orchestration.cluster import RayCluster
from dapo_megatron.orchestration.rollout import RolloutWorkers, engine_seed
from dapo_megatron.rollout.engine import SamplingParams, SyncStats
from dapo_megatron.tracking import MetricsLogger

logger = logging.getLogger(__name__)


PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
"""What SLURM sends before it preempts or ends a job (``--signal`` chooses USR1 and when)."""


class Preempted(Exception):
    """The run was asked to stop by a signal; it finished its step and saved a checkpoint."""

    def __init__(self, signal_name: str, step: int, checkpoint: str) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {checkpoint}; continue with --resume")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class _StopRequest:
    """Catches the preemption signals while a run is live: the first is remembered (the
    step in progress finishes, then the run saves and stops); later ones are only logged,
    so a second signal cannot interrupt the save."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None

    def __call__(self, signum, frame) -> None:
        import signal

        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            logger.warning("received %s: finishing this step, then saving a checkpoint and stopping", name)
        else:
            logger.warning("received %s again: already stopping; the checkpoint being written is kept", name)

    @contextmanager
    def installed(self) -> Iterator[_StopRequest]:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach only the main thread; nothing to install
            return
        previous = {name: signal.signal(getattr(signal, name), self) for name in PREEMPTION_SIGNALS}
        try:
            yield self
        finally:
            for name, handler in previous.items():
                signal.signal(getattr(signal, name), handler)


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
        # The engines start from the actor's weights: both sides hold the same policy.
        system.sync_engines()

        def validate(step: int) -> Optional[float]:
            if val_data is None:
                return None
            values, _ = evaluate_policy(engines, rewards, val_data.prompts, config, tokenizer)
            metrics_log.log(step, values, console=True)
            return values["val/accuracy"]

        val_before = validate(0) if config.trainer.val_before_train and resume_from is None else None
        last_checkpoint = str(resume_from[0]) if resume_from else None

        def save(step: int) -> str:
            """The actor's checkpoint of ``step``, with the trainer's state inside it."""
            state = _trainer_state(step, loader, config, len(train_data.prompts))
            return actor.save(save_dir, config.checkpoint.keep_last, {TRAINER_STATE: state})

        val_after = val_before
        bad_steps = BadStepCounter(config.trainer.max_bad_steps_in_a_row)
        for step in range(start_step + 1, config.trainer.num_steps + 1):
            # 1-6. Generate, score and filter; log-probs and updates; weight sync.
            step_metrics = dapo_step(system, loader, sampling, tokenizer, step)

            # 7. Metrics, checkpoint, validation.
            metrics_log.log(step, step_metrics)
            bad_steps.record(step, step_metrics, last_checkpoint)
            due = config.checkpoint.save_every and (
                step % config.checkpoint.save_every == 0 or step == config.trainer.num_steps
            )
            if due or stop.signal_name is not None:
                last_checkpoint = save(step)
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


@dataclass
class System:
    """The running parts of a run, started by :func:`start_system`: the actor's ranks, the
    rollout engines, the reward pool and the preemption-signal catcher."""

    config: Config
    actor: ActorGroup
    engines: RolloutWorkers
    rewards: RewardPool
    stop: _StopRequest

    def sync_engines(self) -> SyncStats:
        """The actor's current weights into every engine."""
        r = self.config.rollout
        return self.actor.sync_weights(
            self.engines.handles, r.weight_sync_bucket_mb * 2**20, self.engines.num_update_ranks
        )


def start_system(config: Config, run_dir: Path, stack: ExitStack) -> System:
    """Start Ray (logs under ``run_dir``), the reward pool, the actor and the engines;
    ``stack`` stops each of them when it closes. ``train`` and ``bench`` run the same one."""
    r = config.rollout
    cpus = max(os.cpu_count() or 1, config.parallel.world_size + r.num_engines + 1)
    stack.enter_context(RayCluster(config.ray, run_dir, config.ray.num_cpus or cpus))
    # After ray.init, which installs its own SIGTERM handler (it would end the process).
    stop = stack.enter_context(_StopRequest().installed())
    rewards = RewardPool(config.algorithm.reward_fn, config.algorithm.reward_timeout_s, min(os.cpu_count() or 1, 8))
    stack.callback(rewards.close)
    actor = ActorGroup(config)
    stack.callback(actor.shutdown)
    engines = RolloutWorkers(config)
    stack.callback(engines.shutdown)
    return System(config, actor, engines, rewards, stop)


def training_sampling(config: Config, tokenizer) -> SamplingParams:
    """``rollout.*``: the sampling of training rollouts (stopping at the tokenizer's EOS)."""
    r = config.rollout
    return SamplingParams(r.temperature, r.top_p, r.top_k, r.max_response_length, (tokenizer.eos_token_id,))


def dapo_step(system: System, loader: PromptLoader, sampling: SamplingParams, tokenizer, step: int) -> dict[str, float]:
    """Steps 1-6 of DAPO (see the module docstring); the step's metrics, with each
    phase's seconds (``time/<phase>``), the whole call's (``time/step``, metrics
    included) and the part of it in no phase (``time/outside_phases``)."""
    config, actor, engines = system.config, system.actor, system.engines
    r, a, d = config.rollout, config.algorithm, config.data
    start = time.perf_counter()
    times: dict[str, float] = {}

    # 1-4. Prompts, responses, rewards, dynamic sampling: the step's groups.
    samples, rollout_metrics = _collect_groups(
        engines, system.rewards, loader, sampling, config, tokenizer, step, times
    )

    # 5. Advantages by prompt identity; old log-probs; DAPO updates.
    batch = build_policy_batch(samples, a)
    rollout_log_probs = engine_log_prob_grid(samples, batch)  # [batch, seq]
    if r.colocate:
        engines.release_memory()
    entropy, correction_metrics = None, {}
    if a.use_rollout_log_probs:
        batch.old_log_probs = rollout_log_probs  # the sampling policy is the old one
    else:
        with _timed(times, "old_log_prob"):
            batch.old_log_probs, entropy = actor.compute_log_probs(batch, r.temperature)
        mask = batch.response_mask()
        correction_metrics = {
            f"rollout_mismatch/{k}": v
            for k, v in mismatch_metrics(batch.old_log_probs, rollout_log_probs, mask, a.rollout_correction_cap).items()
        }
        if a.rollout_correction != "none":
            batch.token_weights, applied = correction_weights(
                batch.old_log_probs,
                rollout_log_probs,
                mask,
                a.rollout_correction,
                a.rollout_correction_level,
                a.rollout_correction_cap,
            )
            correction_metrics.update({f"rollout_correction/{k}": v for k, v in applied.items()})
    with _timed(times, "train"):
        updates = actor.train(batch, d.train_batch_size * r.n_samples_per_prompt // d.mini_batch_size, r.temperature)

    # 6. Weight sync into every engine.
    if r.colocate:
        engines.resume_memory()
    with _timed(times, "sync"):
        sync = system.sync_engines()
    metrics = {
        **rollout_metrics,
        **_step_metrics(samples, batch, rollout_log_probs, entropy, updates, sync, times),
        **correction_metrics,
    }
    metrics["time/step"] = time.perf_counter() - start
    metrics["time/outside_phases"] = metrics["time/step"] - sum(times.values())
    return metrics


@contextmanager
def _timed(times: dict[str, float], phase: str) -> Iterator[None]:
    """Add the block's wall time to ``times[phase]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        times[phase] = times.get(phase, 0.0) + time.perf_counter() - start


def _collect_groups(
    engines: RolloutWorkers,
    rewards: RewardPool,
    loader: PromptLoader,
    sampling: SamplingParams,
    config: Config,
    tokenizer,
    step: int,
    times: dict[str, float],
) -> tuple[list[Sample], dict[str, float]]:
    """Rounds of generation and scoring until dynamic sampling holds ``train_batch_size``
    groups (or fails after ``max_num_gen_batches`` rounds, naming the knobs). Returns the
    kept samples (groups consecutive) and the rollout's metrics."""
    r, a, d = config.rollout, config.algorithm, config.data
    accumulator = DynamicSamplingAccumulator(
        d.train_batch_size, r.n_samples_per_prompt, a.max_num_gen_batches, filter_groups=a.dynamic_sampling
    )
    generated_tokens = all_equal = groups = timeouts = errors = 0
    round_index = 0
    while not accumulator.is_full:
        prompts = loader.next_batch(d.gen_batch_size or d.train_batch_size)
        params = replace(sampling, seed=engine_seed(r.seed, step, round_index))
        samples = generate_and_score(
            engines, rewards, prompts, params, r.n_samples_per_prompt, round_index, config, tokenizer, times
        )
        generated_tokens += sum(len(s.response_ids) for s in samples)
        timeouts += sum(s.timed_out for s in samples)
        errors += sum(s.reward_error for s in samples)
        outcomes: dict = {}
        for sample in samples:
            outcomes.setdefault(sample.group_id, set()).add(sample.correct)
        groups += len(outcomes)
        all_equal += sum(len(o) == 1 for o in outcomes.values())
        round_index += 1
        accumulator.add(samples, [float(s.correct) for s in samples])
    kept, _, sampling_metrics = accumulator.take()
    metrics = {
        **response_metrics(kept, r.max_response_length),
        # Every reward call of the step counts, also those whose groups were dropped.
        "reward/timeouts": float(timeouts),
        "reward/errors": float(errors),
        **{f"dynamic_sampling/{k}": v for k, v in sampling_metrics.items()},
        "dynamic_sampling/batch_groups": len(kept) / r.n_samples_per_prompt,
        "dynamic_sampling/all_equal_share": all_equal / max(groups, 1),
        "throughput/generate_tokens_per_s": generated_tokens / max(times["generate"], 1e-9),
        "throughput/reward_responses_per_s": groups * r.n_samples_per_prompt / max(times["reward"], 1e-9),
        "data/epoch": float(loader.epoch),
    }
    return kept, metrics


def generate_and_score(
    engines: RolloutWorkers,
    rewards: RewardPool,
    prompts: list,
    params: SamplingParams,
    n: int,
    round_index: int,
    config: Config,
    tokenizer,
    times: dict[str, float],
) -> list[Sample]:
    """``n`` responses per prompt, scored with the overlong punishment; the seconds of
    both go to ``times['generate']`` and ``times['reward']``."""
    with _timed(times, "generate"):
        generations = engines.generate([list(p.token_ids) for p in prompts], params, n)
    samples = samples_from_generations(prompts, generations, round_index, tokenizer)
    with _timed(times, "reward"):
        results = rewards.score([s.text for s in samples], [s.prompt.ground_truth for s in samples])
        apply_rewards(samples, results, config.algorithm, config.rollout.max_response_length)
    return samples


def _step_metrics(
    samples: list[Sample],
    batch: PolicyBatch,
    rollout_log_probs: torch.Tensor,
    entropy: Optional[torch.Tensor],
    updates: list[dict[str, float]],
    sync: SyncStats,
    times: dict[str, float],
) -> dict[str, float]:
    """The actor's, the train/rollout gap's and the phases' metrics of one step (the
    actor's old-policy figures only when it computed them: ``entropy`` given)."""
    mask = batch.response_mask()  # [batch, seq]
    tokens = float(batch.seq_lengths.sum())
    metrics = {
        **_update_metrics(updates),
        "sync/gb_per_s": sync.num_bytes / max(sync.seconds, 1e-9) / 1e9,
        **{f"time/{k}": v for k, v in times.items()},
        "throughput/train_tokens_per_s": tokens / max(times["train"], 1e-9),
    }
    if entropy is not None:
        gap = rollout_consistency(batch.old_log_probs, rollout_log_probs, mask)
        metrics.update({f"rollout/{k}": v for k, v in gap.items()})
        metrics["actor/old_entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
        metrics["actor/gen_prob_mean"] = float((batch.old_log_probs.exp() * mask).sum() / mask.sum().clamp(min=1))
        metrics["throughput/old_log_prob_tokens_per_s"] = tokens / max(times["old_log_prob"], 1e-9)
    return metrics


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


def load_initial_weights(actor: ActorGroup, config: Config) -> None:
    """A converted Megatron checkpoint (``checkpoint.load_dir``), else the HF folder's
    safetensors (converted on load), else the random initialisation (with a warning)."""
    from dapo_megatron.ckpt.dcp_io import latest_checkpoint

    load_dir = config.checkpoint.load_dir
    if load_dir is not None:
        path = latest_checkpoint(load_dir) or Path(load_dir)
        if not Path(path).exists():
            raise ConfigError(f"checkpoint.load_dir={load_dir!r} does not exist")
        logger.info("initial weights from the Megatron checkpoint %s", path)
        actor.load_weights("megatron", str(path))
        return
    folder = hf_weights_folder(config.model)
    if folder is not None and any(folder.glob("*.safetensors")):
        logger.info("initial weights from the HF checkpoint %s (converted on load)", folder)
        actor.load_weights("hf", str(folder))
        return
    if config.model.hf_weights is not None:
        raise ConfigError(
            f"model.hf_weights={config.model.hf_weights!r} holds no *.safetensors files; point it at an HF model "
            f"folder (for the demo, run `make demo` or examples/demo/prepare.py first)"
        )
    logger.warning("no checkpoint.load_dir and no safetensors next to model.hf_config: training from random weights")


def _update_metrics(all_updates: list[dict[str, float]]) -> dict[str, float]:
    """The step's DAPO updates as one set of metrics: token-weighted means, the largest
    ratio, the last learning rate. Mini-batches without loss tokens (all rows filtered)
    made no update and are only counted."""
    updates = [u for u in all_updates if not u.get("empty")] or all_updates
    tokens = sum(u["tokens"] for u in updates) or 1.0

    def mean(key: str) -> float:
        return sum(u[key] * u["tokens"] for u in updates) / tokens

    return {
        "actor/loss": sum(u["loss"] for u in updates) / len(updates),
        "actor/entropy": mean("entropy"),
        "actor/mean_prob": mean("mean_prob"),
        "actor/pg_clipfrac_low": mean("pg_clipfrac_low"),
        "actor/pg_clipfrac_high": mean("pg_clipfrac_high"),
        "actor/pg_clipfrac_dual": mean("pg_clipfrac_dual"),
        "actor/approx_kl": mean("approx_kl"),
        "actor/ratio_mean": mean("ratio_mean"),
        "actor/ratio_max": max(u["ratio_max"] for u in updates),
        "actor/log_ratio_clamped": mean("log_ratio_clamped"),
        "actor/empty_mini_batches": float(sum(u.get("empty", 0.0) for u in all_updates)),
        "actor/first_update_ratio_max": updates[0]["ratio_max"],
        "actor/grad_norm": sum(u["grad_norm"] for u in updates) / len(updates),
        "actor/lr": updates[-1]["lr"],
        "actor/num_updates": float(len(updates)),
        "actor/updates_skipped": sum(u["update_skipped"] for u in updates),
        "actor/nonfinite_updates": sum(u.get("nonfinite", 0.0) for u in updates),
        "actor/tokens": float(tokens),
    }


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


def _trainer_state(step: int, loader: PromptLoader, config: Config, num_prompts: int) -> str:
    """What a resumed run needs besides the actor: the step, the data position and what
    the rollout seeds derive from. Generation seeds are a function of (rollout.seed, step,
    round), and dynamic sampling drops its surplus at the end of every step, so no sampler
    state or leftover samples need saving."""
    return json.dumps(
        {
            "step": step,
            "data": loader.state_dict(),
            "num_prompts": num_prompts,
            "rollout_seed": config.rollout.seed,
            "metrics_step": step,
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
    if state["rollout_seed"] != config.rollout.seed:
        logger.warning(
            "rollout.seed is %d, the run was saved with %d: the resumed steps sample differently from an "
            "uninterrupted run",
            config.rollout.seed,
            state["rollout_seed"],
        )
