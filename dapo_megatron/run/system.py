"""The running system of a run, and what it starts from.

:func:`start_system` starts the parts of a run (Ray, the reward pool, the actor's ranks,
the rollout engines) as one :class:`RunningSystem`; ``train`` and ``bench`` run the same one.
:func:`load_run_data` reads what they work on (the tokenizer, the prompts), and
:func:`load_initial_weights` gives the actor its first weights (and the KL penalty its
reference, :func:`reference_weights`).
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dapo_megatron.algo.rewards.pool import RewardPool
from dapo_megatron.config import AlgorithmConfig, Config, ConfigError
from dapo_megatron.data import (
    PromptDataset,
    PromptLoader,
    load_tokenizer,
    validation_dataset,
    warn_if_prompts_lose_text,
)
from dapo_megatron.orchestration.actor_group import ActorGroup
from dapo_megatron.orchestration.cluster import RayCluster, async_shares_devices
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.run.preflight import check_tokenizer_fits
from dapo_megatron.run.signals import StopRequest
from dapo_megatron.weight_sync.bucket import SyncStats

logger = logging.getLogger(__name__)


@dataclass
class RunningSystem:
    """The running parts of a run, started by :func:`start_system`: the actor's ranks, the
    rollout engines, the reward pool and the preemption-signal catcher."""

    config: Config
    actor: ActorGroup
    engines: RolloutWorkers
    rewards: RewardPool
    stop: StopRequest

    def sync_engines(self, version: int) -> SyncStats:
        """The actor's current weights into every engine, which from then on stamp what
        they generate with ``version`` (the actor step the weights come from)."""
        r = self.config.rollout
        stats = self.actor.sync_weights(
            self.engines.handles,
            r.weight_sync_bucket_mb * 2**20,
            self.engines.num_update_ranks,
            names=self.engines.names,
        )
        self.engines.set_weight_version(version)
        return stats


def start_system(config: Config, run_dir: Path, stack: ExitStack) -> RunningSystem:
    """Start Ray (logs under ``run_dir``), the reward pool, the actor and the engines;
    ``stack`` stops each of them when it closes. ``train`` and ``bench`` run the same one."""
    r = config.rollout
    shared = async_shares_devices(config)
    if shared:
        logger.warning(
            "trainer.async_generation: %s, so generating ahead competes with training and can make steps slower "
            "than synchronous ones (docs/off_policy.md: when asynchronous generation helps)",
            shared,
        )
    cpus = max(os.cpu_count() or 1, config.parallel.world_size + r.num_engines + 1)
    stack.enter_context(RayCluster(config.ray, run_dir, config.ray.num_cpus or cpus))
    # After ray.init, which installs its own SIGTERM handler (it would end the process).
    stop = stack.enter_context(StopRequest(config.trainer.stop_grace_s).installed())
    rewards = start_rewards(config.algorithm, stack)
    asked: list[RolloutWorkers] = []

    def ask_for_engines(group: ActorGroup) -> None:  # their processes start while the actor's ranks set up
        asked.append(RolloutWorkers(config, start=False, placement_group=group.placement_group))
        stack.callback(asked[0].shutdown)  # if the actor's start fails

    actor = ActorGroup(config, while_ranks_start=ask_for_engines)
    stack.callback(actor.shutdown)
    engines = asked[0]
    # The engines stop first: they map the ranks' shared memory, which the ranks' shutdown
    # removes (an engine unmapping it afterwards aborts with "could not unlink").
    stack.callback(engines.shutdown)
    stop.check_starting()
    engines.start()
    return RunningSystem(config, actor, engines, rewards, stop)


def start_rewards(algorithm: AlgorithmConfig, stack: ExitStack) -> RewardPool:
    """The pool that scores ``algorithm.reward_fn`` (a worker per core, up to 8), closed
    when ``stack`` closes."""
    rewards = RewardPool(
        algorithm.reward_fn,
        algorithm.reward_timeout_s,
        min(os.cpu_count() or 1, 8),
        error_score=algorithm.reward_error_score,
        memory_mb=algorithm.reward_worker_memory_mb,
    )
    stack.callback(rewards.close)
    return rewards


def give_engines_their_memory_back(actor, engines) -> None:
    """After training, colocated engines take their memory back: the actor's ranks first
    return what their CUDA caching allocator holds unused (the activations' blocks),
    which the engines would otherwise not find free."""
    actor.free_cached_memory()
    engines.resume_memory()


def load_run_data(config: Config) -> tuple:
    """The tokenizer, the training and validation prompts, and the training loader at
    its start: ``(tokenizer, train_data, val_data or None, loader)``."""
    r, d = config.rollout, config.data
    tokenizer = load_tokenizer(d, config.model.hf_weights_folder)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer of data.tokenizer={d.tokenizer!r} has no EOS token to stop responses on")
    train_data = PromptDataset(d.train_files, tokenizer, d, r.max_prompt_length)
    val_data = validation_dataset(d.val_files, tokenizer, d, r.max_prompt_length) if d.val_files else None
    check_tokenizer_fits(config, tokenizer, [train_data] + ([val_data] if val_data is not None else []))
    warn_if_prompts_lose_text(train_data, tokenizer)
    return tokenizer, train_data, val_data, PromptLoader(train_data, seed=d.seed, shuffle=d.shuffle)


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
    folder = config.model.hf_weights_folder
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
