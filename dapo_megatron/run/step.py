"""One DAPO step on the running system: what ``train`` and ``bench`` both run.

:func:`start_system` starts the parts of a run (Ray, the reward pool, the actor's
ranks, the rollout engines), :func:`load_run_data` reads what they work on and
:func:`load_initial_weights` gives the actor its first weights (and the KL penalty's
reference, :func:`reference_weights`); :class:`Stepper` runs steps on them: generate and score
until dynamic sampling has the batch, advantages, the actor's old log-probs (or the
engine's, with ``algorithm.use_rollout_log_probs``), the mismatch metrics and the
rollout correction, the DAPO updates, the weight sync. With
``trainer.async_generation`` the next batch is generated while the actor trains.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from dapo_megatron.actor.batch import PolicyBatch
from dapo_megatron.algo import DynamicSamplingAccumulator
from dapo_megatron.algo.metrics import rollout_consistency
from dapo_megatron.algo.rewards.pool import RewardPool
from dapo_megatron.algo.rollout_correction import correction_weights, mismatch_metrics
from dapo_megatron.config import Config, ConfigError, carries_over, hf_weights_folder, rollout_correction_of
from dapo_megatron.data import (
    PromptDataset,
    PromptLoader,
    load_tokenizer,
    validation_dataset,
    warn_if_prompts_lose_text,
)
from dapo_megatron.orchestration.actor_group import ActorGroup
from dapo_megatron.orchestration.calls import cause_of
from dapo_megatron.orchestration.cluster import RayCluster, async_shares_devices
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.rollout.seeds import sampling_seeds
from dapo_megatron.run.preflight import check_tokenizer_fits
from dapo_megatron.sampling.samples import (
    Sample,
    apply_rewards,
    build_policy_batch,
    drop_aborted_groups,
    engine_log_prob_grid,
    response_metrics,
    samples_from_generations,
)
from dapo_megatron.sampling.streaming import StreamingSampler
from dapo_megatron.weight_sync.bucket import SyncStats

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
"""What SLURM sends before it preempts or ends a job (``--signal`` chooses USR1 and when)."""


class StartupInterrupted(BaseException):
    """A preemption signal arrived while the system was starting: there is no step to
    finish and nothing to save, so the start is abandoned (everything it started is
    stopped, the Ray token removed) at once. Like ``KeyboardInterrupt`` it is not an
    ``Exception``: the handler raises it wherever the main thread happens to be, and code
    that catches ``Exception`` there (``logging`` does, around every write of a record)
    must not swallow it."""

    def __init__(self, signal_name: str, signum: int) -> None:
        super().__init__(f"received {signal_name} while the run was starting; everything it started was stopped")
        self.signal_name, self.signum = signal_name, signum


class StopNow(BaseException):
    """A preemption signal arrived while the run waited for generation (see
    :meth:`StopRequest.abortable`): what is being generated is abandoned, and the run
    saves the last step it completed. Not an ``Exception``, for the reason
    :class:`StartupInterrupted` is not."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"received {signal_name}: the generation in flight is abandoned")
        self.signal_name = signal_name


class StopOutOfTime(BaseException):
    """Stopping after a preemption signal (finishing the actor's work in flight, saving)
    took longer than ``trainer.stop_grace_s``: the run ends without that save, its
    previous checkpoint the latest, so that the job is requeued before SLURM kills it."""

    def __init__(self, signal_name: str, grace_s: float) -> None:
        super().__init__(
            f"stopping after {signal_name} took longer than trainer.stop_grace_s={grace_s:g} s; the run ended without "
            "saving the step in progress"
        )
        self.signal_name, self.grace_s = signal_name, grace_s


STOP_BACKSTOP_S = 60.0
"""After ``trainer.stop_grace_s``, how long the run's own clean-up may take (it stops its
workers, each within a bound) before the process exits regardless."""


class StopRequest:
    """Catches the preemption signals while a run is live. The first is remembered: the
    generation in flight, if the run is waiting for one, is abandoned at once
    (:meth:`abortable`), the actor's work in flight finishes, the last completed step is
    saved and the run stops; later ones are only logged, so a second signal cannot
    interrupt the save. All of it within ``grace_s`` (``trainer.stop_grace_s``): past it,
    the next signal handler call raises :class:`StopOutOfTime` wherever the main thread
    is, and :data:`STOP_BACKSTOP_S` later the process exits with status 75.

    Until :meth:`running` is called (the system is still starting: placing ranks, loading
    weights), a signal raises :class:`StartupInterrupted` instead: a start that waits on
    resources must not keep a job's allocation, or leave its files, after it was told to
    stop."""

    def __init__(self, grace_s: float = float("inf")) -> None:
        self.signal_name: Optional[str] = None
        self.starting = True
        self.interrupted: Optional[StartupInterrupted] = None
        self.grace_s = grace_s
        self.out_of_time = False
        self._saved = False  # the stop's checkpoint is written: the grace no longer interrupts
        self._abortable = False
        self._timers: list[threading.Timer] = []

    def running(self) -> None:
        """The system has started: from now on a signal stops the run after its step.
        Raises the :class:`StartupInterrupted` of a signal that arrived while starting (see
        :meth:`check_starting`)."""
        self.check_starting()
        self.starting = False

    def check_starting(self) -> None:
        """Raises the :class:`StartupInterrupted` of a signal that arrived while starting,
        in case something between the handler and here caught it (a library's ``except
        BaseException``): the start stops at the next stage instead of running on."""
        if self.interrupted is not None:
            raise self.interrupted

    @contextmanager
    def abortable(self) -> Iterator[None]:
        """Around a wait for generation that a stop may abandon: a signal that came before
        it or comes during it raises :class:`StopNow` (the caller keeps, or restores, the
        state from before the generation began)."""
        if self.signal_name is not None and not self.starting:
            raise StopNow(self.signal_name)
        self._abortable = True
        try:
            yield
        finally:
            self._abortable = False

    def __call__(self, signum, frame) -> None:
        import signal

        name = signal.Signals(signum).name
        if self.starting:
            if self.interrupted is None:
                self.interrupted = StartupInterrupted(name, signum)
            raise self.interrupted
        if self.out_of_time and not self._saved:
            self.out_of_time = False  # raised once; the clean-up that follows must run
            raise StopOutOfTime(self.signal_name, self.grace_s)
        if self.signal_name is not None:
            logger.warning("received %s again: already stopping; the checkpoint being written is kept", name)
            return
        self.signal_name = name
        self._start_grace_clock()
        if self._abortable:
            logger.warning(
                "received %s: abandoning the generation in flight, saving the last completed step and stopping "
                "(within trainer.stop_grace_s=%g s)",
                name,
                self.grace_s,
            )
            raise StopNow(name)
        logger.warning(
            "received %s: finishing the actor's work in flight, then saving a checkpoint and stopping (within "
            "trainer.stop_grace_s=%g s)",
            name,
            self.grace_s,
        )

    def _start_grace_clock(self) -> None:
        """At ``grace_s``: interrupt the main thread (a real signal, so that a blocking
        call returns) with :class:`StopOutOfTime`; :data:`STOP_BACKSTOP_S` later, exit."""
        import signal

        if self.grace_s == float("inf"):
            return
        main = threading.main_thread().ident

        def out_of_time() -> None:
            if self._saved:
                return
            logger.error("trainer.stop_grace_s=%g s have passed since the stop signal: ending the run", self.grace_s)
            self.out_of_time = True
            signal.pthread_kill(main, signal.SIGUSR1)

        def backstop() -> None:
            # Not through logging: its handlers' locks may be held by the main thread.
            os.write(2, f"the run's clean-up did not end within {STOP_BACKSTOP_S:g} s: exiting\n".encode())
            os._exit(75)

        self._timers = [
            threading.Timer(self.grace_s, out_of_time),
            threading.Timer(self.grace_s + STOP_BACKSTOP_S, backstop),
        ]
        for timer in self._timers:
            timer.daemon = True
            timer.start()

    def saved(self) -> None:
        """The stop's checkpoint is written: nothing is interrupted any more (the clean-up
        that follows stays under the backstop)."""
        self._saved = True
        if self._timers:
            self._timers[0].cancel()

    def cancel(self) -> None:
        """The run has ended: the grace clock stops."""
        self._saved = True
        for timer in self._timers:
            timer.cancel()

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        import signal

        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach only the main thread; nothing to install
            return
        previous = {name: signal.signal(getattr(signal, name), self) for name in PREEMPTION_SIGNALS}
        try:
            yield self
        finally:
            self.cancel()
            for name, handler in previous.items():
                signal.signal(getattr(signal, name), handler)


@dataclass
class System:
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


def start_system(config: Config, run_dir: Path, stack: ExitStack) -> System:
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
    rewards = RewardPool(
        config.algorithm.reward_fn,
        config.algorithm.reward_timeout_s,
        min(os.cpu_count() or 1, 8),
        error_score=config.algorithm.reward_error_score,
        memory_mb=config.algorithm.reward_worker_memory_mb,
    )
    stack.callback(rewards.close)
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
    return System(config, actor, engines, rewards, stop)


def give_engines_their_memory_back(actor, engines) -> None:
    """After training, colocated engines take their memory back: the actor's ranks first
    return what their CUDA caching allocator holds unused (the activations' blocks),
    which the engines would otherwise not find free."""
    actor.free_cached_memory()
    engines.resume_memory()


def training_sampling(config: Config, tokenizer) -> SamplingParams:
    """``rollout.*``: the sampling of training rollouts (stopping at the tokenizer's EOS)."""
    r = config.rollout
    return SamplingParams(r.temperature, r.top_p, r.top_k, r.max_response_length, (tokenizer.eos_token_id,))


def round_sampling(
    sampling: SamplingParams, seed: int, step: int, round_index: int, num_prompts: int, n: int
) -> SamplingParams:
    """``sampling`` with a seed of its own for every response row of generation round
    ``round_index`` of ``step`` (see :func:`sampling_seeds`)."""
    return replace(sampling, seed=None, row_seeds=sampling_seeds(seed, step, round_index, num_prompts, n))


class StaleBatch(RuntimeError):
    """A batch sampled more than one step before the actor's weights (or after them)."""


def check_staleness(samples: list[Sample], version: int, step: int, max_lag: int = 1) -> list[int]:
    """Each sample's staleness (actor version minus its policy version: its oldest
    token's); raises :class:`StaleBatch` naming the first sample beyond ``max_lag``
    versions (or from the future)."""
    staleness = [version - s.policy_version for s in samples]
    for index, (sample, lag) in enumerate(zip(samples, staleness)):
        if not 0 <= lag <= max_lag:
            raise StaleBatch(
                f"step {step}: sample {index} (prompt {sample.prompt.prompt_id}) was generated by policy version "
                f"{sample.policy_version}, the actor is at version {version}; this run allows a lag of 0 to "
                f"{max_lag} (one-step-off async generation: 1; streamed carry-over and partial rollouts: "
                "rollout.max_staleness)"
            )
    return staleness


def allowed_staleness(config: Config) -> int:
    """The most versions a trained sample may lag the actor: ``rollout.max_staleness``
    when streamed generation carries groups or partial responses over, else 1."""
    return config.rollout.max_staleness if carries_over(config.rollout) else 1


class GenerationAheadFailed(RuntimeError):
    """Generating the next step's batch in the background failed; the step that ran
    meanwhile was trained (and is saved before this is raised)."""

    def __init__(self, step: int, cause: BaseException, checkpoint: Optional[str] = None) -> None:
        saved = f"; step {step - 1} was trained and saved in {checkpoint} (--resume continues from it)"
        super().__init__(
            f"generating step {step}'s batch (during step {step - 1}) failed: {cause_of(cause)}"
            + (saved if checkpoint else "")
        )
        self.step, self.cause, self.checkpoint = step, cause, checkpoint


def _in_background(function, *args) -> Future:
    """``function(*args)`` in a daemon thread: nothing waits for it at shutdown (after an
    error or Ctrl-C the engines are stopped, which ends its remote calls)."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(*args))
        except BaseException as exc:  # handed to whoever waits for the result
            future.set_exception(exc)

    threading.Thread(target=run, name="generate-ahead", daemon=True).start()
    return future


class Stepper:
    """Runs DAPO steps 1-6 (see :mod:`dapo_megatron.run.trainer`) on a started :class:`System`.

    In sync mode a step generates its batch, then trains on it. With
    ``trainer.async_generation`` the generation of step k+1's batch (with the weights the
    engines hold, the actor's before step k's update) runs in a background thread while
    the actor trains on step k's; the step waits for it before the weight sync, so
    between steps nothing is in flight, and the batch generated ahead is part of the
    state a checkpoint keeps (:meth:`state_dict`). Every sample carries the weight version
    its engine reports having sampled it with; a batch more than one step behind the
    actor is refused.

    A failure of the generation ahead does not cost the step that ran meanwhile: the
    step finishes without a weight sync (the engines are suspect), its metrics are
    returned, and :attr:`failed_ahead` holds the error for the trainer to raise after
    it has logged and saved the step (or, at the last step, to report and go on).
    """

    def __init__(
        self,
        system: System,
        loader: PromptLoader,
        sampling: SamplingParams,
        tokenizer,
        version: int = 0,
        config: Optional[Config] = None,
    ) -> None:
        """``config``: the system's, unless given (a benchmark compares generation modes
        on one running system)."""
        self.system, self.loader, self.sampling, self.tokenizer = system, loader, sampling, tokenizer
        self.config = config or system.config
        self.stream = (
            StreamingSampler(system.engines, system.rewards, loader, sampling, self.config, tokenizer)
            if self.config.rollout.streaming
            else None
        )
        r = self.config.rollout
        if (
            carries_over(r)
            and rollout_correction_of(self.config) == "none"
            and not self.config.algorithm.use_rollout_log_probs
        ):
            logger.warning(
                "rollout.carry_over / rollout.partial_rollout train on tokens up to rollout.max_staleness=%d "
                "versions old, and algorithm.rollout_correction=none leaves them uncorrected (auto: token TIS)",
                r.max_staleness,
            )
        self.asynchronous = self.config.trainer.async_generation
        self.version = version  # the actor's weights: the number of steps trained
        self.ahead: Optional[tuple[list[Sample], dict[str, float], dict[str, float]]] = None
        self.failed_ahead: Optional[GenerationAheadFailed] = None
        self.engines_behind = False  # the last step's sync was skipped
        # The state a checkpoint of the actor's weights keeps when the step that followed
        # them was abandoned on a stop signal (see :meth:`checkpoint_state`).
        self.abandoned: Optional[RunState] = None
        self.histograms: dict[str, torch.Tensor] = {}  # the last step's distributions (name -> values)

    def close(self) -> None:
        """Nothing to wait for: a generation still running ahead is abandoned (its thread
        is a daemon; stopping the engines ends its calls)."""

    def _generate(self, step: int) -> tuple[list[Sample], dict[str, float], dict[str, float]]:
        """Step ``step``'s batch with the engines' current weights, its rollout metrics
        and the seconds of its phases."""
        times: dict[str, float] = {}
        if self.stream is not None:
            samples, metrics = self.stream.collect(step, self.version, times)
            return samples, metrics, times
        samples, metrics = _collect_groups(
            self.system.engines,
            self.system.rewards,
            self.loader,
            self.sampling,
            self.config,
            self.tokenizer,
            step,
            times,
        )
        return samples, metrics, times

    def sync(self) -> SyncStats:
        """The actor's weights into the engines (after a step that skipped its sync)."""
        stats = self.system.sync_engines(self.version)
        self.engines_behind = False
        return stats

    def step(self, step: int, generate_ahead: bool) -> dict[str, float]:
        """One step; its metrics, with each phase's seconds (``time/<phase>``), the whole
        call's (``time/step``, metrics included) and, in sync mode, the part in no phase
        (``time/outside_phases``). ``generate_ahead``: in async mode, generate step
        ``step + 1``'s batch meanwhile (the trainer asks for it unless the run ends here
        without a checkpoint)."""
        config, actor, engines = self.config, self.system.actor, self.system.engines
        r, a, d = config.rollout, config.algorithm, config.data
        start = time.perf_counter()
        if self.failed_ahead is not None or self.engines_behind:
            raise RuntimeError("step() after a failed generation ahead: the engines were not synced")
        stop = self.system.stop
        if self.ahead is not None:
            (samples, rollout_metrics, times), self.ahead = self.ahead, None
        else:
            before = self.checkpoint_state()  # before this step draws a prompt
            try:
                with stop.abortable():
                    samples, rollout_metrics, times = self._generate(step)
            except StopNow:
                self.abandoned = before
                raise
        staleness = check_staleness(samples, self.version, step, allowed_staleness(config))
        pending, before_ahead = None, None
        if self.asynchronous and generate_ahead and stop.signal_name is None:
            before_ahead = RunState(self.loader.state_dict(), None, None)
            pending = _in_background(self._generate, step + 1)

        # 5. Advantages by prompt identity; old log-probs; DAPO updates.
        batch = build_policy_batch(samples, a)
        num_updates = d.train_batch_size * r.n_samples_per_prompt // d.mini_batch_size
        rollout_log_probs = engine_log_prob_grid(samples, batch)  # [batch, seq]
        # Release the engines' memory for training (colocated); not while they generate ahead.
        release = r.colocate and not self.asynchronous
        if release:
            engines.release_memory()
        entropy, correction_metrics = None, {}
        correction = rollout_correction_of(config)
        if a.use_rollout_log_probs:
            batch.old_log_probs = rollout_log_probs  # the sampling policy is the old one
        else:
            with _timed(times, "old_log_prob"):
                batch.old_log_probs, entropy = actor.compute_log_probs(batch, r.temperature, num_updates)
            mask = batch.response_mask()
            correction_metrics = {
                f"rollout_mismatch/{k}": v
                for k, v in mismatch_metrics(
                    batch.old_log_probs, rollout_log_probs, mask, a.rollout_correction_cap
                ).items()
            }
            if correction != "none":
                batch.token_weights, applied = correction_weights(
                    batch.old_log_probs,
                    rollout_log_probs,
                    mask,
                    correction,
                    a.rollout_correction_level,
                    a.rollout_correction_cap,
                )
                correction_metrics.update({f"rollout_correction/{k}": v for k, v in applied.items()})
        if a.use_kl_loss:
            with _timed(times, "ref_log_prob"):
                batch.ref_log_probs, _ = actor.compute_log_probs(batch, r.temperature, num_updates, reference=True)
        with _timed(times, "train"):
            updates = actor.train(batch, num_updates, r.temperature)
        self.version += 1
        if pending is not None:
            with _timed(times, "wait_for_generation"):
                try:
                    # A batch already generated is kept (the checkpoint holds it, and a
                    # resumed run is exact); only one still generating is abandoned.
                    with stop.abortable() if not pending.done() else nullcontext():
                        self.ahead = pending.result()
                except StopNow:
                    # This step is trained; the next one's generation (its prompts drawn
                    # in the background) is abandoned: the checkpoint keeps the data
                    # position from before it, and a resumed run generates that batch anew,
                    # with this step's weights (one version newer than an uninterrupted run).
                    self.abandoned = before_ahead
                    engines.abandon_calls()
                except Exception as exc:
                    logger.error("step %d: generating step %d's batch failed: %s", step, step + 1, cause_of(exc))
                    self.failed_ahead = GenerationAheadFailed(step + 1, exc)

        # 6. Weight sync into every engine (not into engines whose generation just failed,
        # nor when the run stops: the engines stop with it).
        if release:
            give_engines_their_memory_back(actor, engines)
        sync = SyncStats(0.0, 0, 0, 0)
        if self.failed_ahead is None and stop.signal_name is None:
            with _timed(times, "sync"):
                sync = self.sync()
        else:
            self.engines_behind = True
        metrics = {
            **rollout_metrics,
            **_step_metrics(samples, batch, rollout_log_probs, entropy, updates, sync, times),
            **correction_metrics,
            "staleness/mean": sum(staleness) / len(staleness),
            "staleness/max": float(max(staleness)),
        }
        # Distributions, for TensorBoard's histograms (the trainer logs them with the step).
        self.histograms = {"response/length": torch.tensor([float(len(s.response_ids)) for s in samples])}
        if entropy is not None:  # the actor's old log-probs against the engine's, per loss token
            mask = batch.response_mask().bool()
            self.histograms["rollout/log_prob_gap"] = (batch.old_log_probs - rollout_log_probs)[mask].float()
        metrics["time/step"] = time.perf_counter() - start
        if not self.asynchronous:  # phases overlap in async mode: no remainder to speak of
            metrics["time/outside_phases"] = metrics["time/step"] - sum(times.values())
        return metrics

    def take_failure(self) -> Optional[GenerationAheadFailed]:
        """The failure of the last step's generation ahead, if any (then cleared; the
        engines still need :meth:`sync` before another step)."""
        failure, self.failed_ahead = self.failed_ahead, None
        return failure

    def checkpoint_state(self) -> RunState:
        """What a checkpoint of the actor's current weights keeps besides them: the data
        position, the batch generated ahead, the streamed groups carried over. After a
        stop abandoned the step in progress (:class:`StopNow`), the state from before that
        step drew its prompts, so that a resumed run takes that step whole, as an
        uninterrupted run would have."""
        if self.abandoned is not None:
            return self.abandoned
        stream = self.stream.state_dict() if self.stream is not None else None
        return RunState(self.loader.state_dict(), self.ahead, stream)

    def load_state_dict(self, state: Optional[tuple[list[Sample], dict[str, float], dict[str, float]]]) -> None:
        """The batch generated ahead, from a checkpoint (see :meth:`checkpoint_state`)."""
        self.ahead = state


@dataclass
class RunState:
    """What a checkpoint keeps besides the actor (see :meth:`Stepper.checkpoint_state`)."""

    data: dict
    """The prompt loader's position (:meth:`PromptLoader.state_dict`)."""
    ahead: Optional[tuple[list[Sample], dict[str, float], dict[str, float]]]
    """Async generation: the next step's batch, its rollout metrics and phase seconds."""
    stream: Optional[dict]
    """Streamed generation: the groups carried over and the partial responses
    (:meth:`StreamingSampler.state_dict`)."""


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
    generated_tokens = all_equal = groups = timeouts = errors = aborted = 0
    round_index = 0
    while not accumulator.is_full:
        prompts = loader.next_batch(d.gen_batch_size or d.train_batch_size)
        params = round_sampling(sampling, r.seed, step, round_index, len(prompts), r.n_samples_per_prompt)
        samples = generate_and_score(
            engines, rewards, prompts, params, r.n_samples_per_prompt, round_index, config, tokenizer, times
        )
        generated_tokens += sum(len(s.response_ids) for s in samples)
        samples, round_aborted = drop_aborted_groups(samples)
        aborted += round_aborted
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
        "rollout/aborted_responses": float(aborted),
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


def _update_metrics(all_updates: list[dict[str, float]]) -> dict[str, float]:
    """The step's DAPO updates as one set of metrics: token-weighted means, the largest
    ratio, the last learning rate. Mini-batches without loss tokens (all rows filtered)
    made no update and are only counted."""
    updates = [u for u in all_updates if not u.get("empty")] or all_updates
    tokens = sum(u["tokens"] for u in updates) or 1.0

    def mean(key: str) -> float:
        return sum(u[key] * u["tokens"] for u in updates) / tokens

    # A mixture-of-experts actor's routing (actor/routing.py): the first update's
    # routing_changed is the on-policy one (0); the step reports the later ones' mean and
    # the largest, the rest as means over updates.
    routing = {}
    if "moe_tokens_per_expert_max_over_mean" in updates[0]:
        later = [u["moe_routing_changed"] for u in updates[1:] if "moe_routing_changed" in u]
        routing = {
            "moe/tokens_per_expert_max_over_mean": sum(u["moe_tokens_per_expert_max_over_mean"] for u in updates)
            / len(updates),
            "moe/tokens_per_expert_max_over_mean_worst_layer": max(
                u["moe_tokens_per_expert_max_over_mean_worst_layer"] for u in updates
            ),
            **(
                {"moe/routing_changed": sum(later) / len(later), "moe/routing_changed_max": max(later)} if later else {}
            ),
            **(
                {"moe/load_balancing_loss": sum(u["moe_load_balancing_loss"] for u in updates) / len(updates)}
                if "moe_load_balancing_loss" in updates[0]
                else {}
            ),
        }
    return {
        **routing,
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
        "actor/kl_loss": mean("kl_loss"),
        "actor/empty_mini_batches": float(sum(u.get("empty", 0.0) for u in all_updates)),
        "actor/first_update_ratio_max": updates[0]["ratio_max"],
        "actor/grad_norm": sum(u["grad_norm"] for u in updates) / len(updates),
        "actor/lr": updates[-1]["lr"],
        "actor/num_updates": float(len(updates)),
        "actor/updates_skipped": sum(u["update_skipped"] for u in updates),
        "actor/nonfinite_updates": sum(u.get("nonfinite", 0.0) for u in updates),
        "actor/tokens": float(tokens),
        "actor/padding_share": all_updates[0]["padding_share"],
        "actor/padding_share_unpacked": all_updates[0]["padding_share_unpacked"],
    }


def load_run_data(config: Config) -> tuple:
    """The tokenizer, the training and validation prompts, and the training loader at
    its start: ``(tokenizer, train_data, val_data or None, loader)``."""
    r, d = config.rollout, config.data
    tokenizer = load_tokenizer(d, hf_weights_folder(config.model))
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
