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

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from dapo_megatron.actor.batch import PolicyBatch
from dapo_megatron.algo import DynamicSamplingAccumulator
from dapo_megatron.algo.metrics import rollout_consistency
from dapo_megatron.algo.rewards.pool import RewardPool
from dapo_megatron.config import Config, ConfigError, hf_weights_folder
from dapo_megatron.data import PromptDataset, PromptLoader, load_tokenizer
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


def train(config: Config, inspect: Optional[Callable[[ActorGroup, RolloutWorkers], None]] = None) -> TrainResult:
    """Run ``config.trainer.num_steps`` DAPO steps; see the module docstring.

    ``inspect``, when given, is called with the actor and the engines after the last step,
    before they are shut down (tests compare the engines' weights with the actor's).
    """
    run_dir = Path(config.trainer.output_dir)
    earlier = run_dir / "metrics.jsonl"
    if earlier.exists() and earlier.stat().st_size:
        raise ConfigError(
            f"trainer.output_dir={str(run_dir)!r} already holds a run (metrics.jsonl); choose another "
            "trainer.output_dir or move that run away (nothing in it is touched)"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    r, a, d = config.rollout, config.algorithm, config.data

    tokenizer = load_tokenizer(d, hf_weights_folder(config.model))
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer of data.tokenizer={d.tokenizer!r} has no EOS token to stop responses on")
    train_data = PromptDataset(d.train_files, tokenizer, d, r.max_prompt_length)
    val_data = PromptDataset(d.val_files, tokenizer, d, r.max_prompt_length) if d.val_files else None
    loader = PromptLoader(train_data, seed=d.seed, shuffle=d.shuffle)
    stop = (tokenizer.eos_token_id,)
    sampling = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_response_length, stop)
    val_sampling = SamplingParams(r.val_temperature, r.val_top_p, -1, r.max_response_length, stop, seed=r.seed)
    num_updates = d.train_batch_size * r.n_samples_per_prompt // d.mini_batch_size
    save_dir = config.checkpoint.save_dir or str(run_dir / "checkpoints")

    with ExitStack() as stack:
        cpus = max(os.cpu_count() or 1, config.parallel.world_size + r.num_engines + 1)
        stack.enter_context(RayCluster(config.ray, run_dir, config.ray.num_cpus or cpus))
        rewards = RewardPool(a.reward_fn, a.reward_timeout_s, num_workers=min(os.cpu_count() or 1, 8))
        stack.callback(rewards.close)
        metrics_log = MetricsLogger(run_dir, config.logging, config.trainer.num_steps)
        stack.callback(metrics_log.close)
        actor = ActorGroup(config)
        stack.callback(actor.shutdown)
        engines = RolloutWorkers(config)
        stack.callback(engines.shutdown)

        def sync_engines():
            return actor.sync_weights(engines.handles, r.weight_sync_bucket_mb * 2**20, engines.num_update_ranks)

        _load_initial_weights(actor, config)
        # The engines start from the actor's weights: both sides hold the same policy.
        sync_engines()

        def validate(step: int) -> Optional[float]:
            if val_data is None:
                return None
            values = _validate(engines, rewards, val_data.prompts, val_sampling, config, tokenizer)
            metrics_log.log(step, values, console=True)
            return values["val/accuracy"]

        val_before = validate(0) if config.trainer.val_before_train else None
        last_checkpoint = None
        val_after = val_before
        for step in range(1, config.trainer.num_steps + 1):
            step_start = time.perf_counter()
            times: dict[str, float] = {}

            # 1-4. Prompts, responses, rewards, dynamic sampling: the step's groups.
            samples, rollout_metrics = _collect_groups(
                engines, rewards, loader, sampling, config, tokenizer, step, times
            )

            # 5. Advantages by prompt identity; old log-probs; DAPO updates.
            batch = build_policy_batch(samples, a)
            if r.colocate:
                engines.release_memory()
            with _timed(times, "old_log_prob"):
                batch.old_log_probs, entropy = actor.compute_log_probs(batch, r.temperature)
            with _timed(times, "train"):
                updates = actor.train(batch, num_updates, r.temperature)

            # 6. Weight sync into every engine.
            if r.colocate:
                engines.resume_memory()
            with _timed(times, "sync"):
                sync = sync_engines()
            times["step"] = time.perf_counter() - step_start

            # 7. Metrics, checkpoint, validation.
            metrics_log.log(step, {**rollout_metrics, **_step_metrics(samples, batch, entropy, updates, sync, times)})
            metrics_log.log_histogram(step, "response/length", [len(s.response_ids) for s in samples])
            if config.checkpoint.save_every and (
                step % config.checkpoint.save_every == 0 or step == config.trainer.num_steps
            ):
                last_checkpoint = actor.save(save_dir, config.checkpoint.keep_last)
                _write_trainer_state(Path(last_checkpoint), step, loader)
            if config.trainer.val_every and step % config.trainer.val_every == 0 and step != config.trainer.num_steps:
                validate(step)
        if config.trainer.val_before_train or config.trainer.val_every:
            val_after = validate(config.trainer.num_steps)
        if inspect is not None:
            inspect(actor, engines)
    return TrainResult(run_dir, config.trainer.num_steps, val_before, val_after, last_checkpoint)


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
    generated_tokens = all_equal = groups = 0
    round_index = 0
    while not accumulator.is_full:
        prompts = loader.next_batch(d.gen_batch_size or d.train_batch_size)
        params = replace(sampling, seed=engine_seed(r.seed, step, round_index))
        samples = _generate_and_score(
            engines, rewards, prompts, params, r.n_samples_per_prompt, round_index, config, tokenizer, times
        )
        generated_tokens += sum(len(s.response_ids) for s in samples)
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
        **{f"dynamic_sampling/{k}": v for k, v in sampling_metrics.items()},
        "dynamic_sampling/batch_groups": len(kept) / r.n_samples_per_prompt,
        "dynamic_sampling/all_equal_share": all_equal / max(groups, 1),
        "throughput/generate_tokens_per_s": generated_tokens / max(times["generate"], 1e-9),
        "throughput/reward_responses_per_s": groups * r.n_samples_per_prompt / max(times["reward"], 1e-9),
        "data/epoch": float(loader.epoch),
    }
    return kept, metrics


def _generate_and_score(
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
    entropy: torch.Tensor,
    updates: list[dict[str, float]],
    sync: SyncStats,
    times: dict[str, float],
) -> dict[str, float]:
    """The actor's, the train/rollout gap's and the phases' metrics of one step."""
    mask = batch.response_mask()  # [batch, seq]
    tokens = float(batch.seq_lengths.sum())
    gap = rollout_consistency(batch.old_log_probs, engine_log_prob_grid(samples, batch), mask)
    return {
        **_update_metrics(updates),
        **{f"rollout/{k}": v for k, v in gap.items()},
        "actor/old_entropy": float((entropy * mask).sum() / mask.sum().clamp(min=1)),
        "actor/gen_prob_mean": float((batch.old_log_probs.exp() * mask).sum() / mask.sum().clamp(min=1)),
        "sync/gb_per_s": sync.num_bytes / max(sync.seconds, 1e-9) / 1e9,
        **{f"time/{k}": v for k, v in times.items()},
        "throughput/train_tokens_per_s": tokens / max(times["train"], 1e-9),
        "throughput/old_log_prob_tokens_per_s": tokens / max(times["old_log_prob"], 1e-9),
    }


def _validate(
    engines: RolloutWorkers, rewards: RewardPool, prompts: list, sampling: SamplingParams, config: Config, tokenizer
) -> dict[str, float]:
    """avg@k and pass@k of the current policy on the validation prompts."""
    start = time.perf_counter()
    n = config.rollout.val_n_samples
    samples = _generate_and_score(engines, rewards, prompts, sampling, n, -1, config, tokenizer, {})
    return {**validation_metrics(samples, n), "time/validate": time.perf_counter() - start}


def _load_initial_weights(actor: ActorGroup, config: Config) -> None:
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
        "actor/tokens": float(tokens),
    }


def _write_trainer_state(checkpoint: Path, step: int, loader: PromptLoader) -> None:
    import json

    state = {"step": step, "data": loader.state_dict(), "torch_seed": torch.initial_seed()}
    tmp = checkpoint / "trainer_state.json.tmp"
    tmp.write_text(json.dumps(state) + "\n")
    tmp.replace(checkpoint / "trainer_state.json")
