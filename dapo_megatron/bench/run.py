"""``dapo-megatron bench``: every phase of a DAPO step, measured through the real system.

The benchmark starts what ``train`` starts (:func:`dapo_megatron.run.system.start_system`:
Ray, the actor's Megatron ranks, the rollout engines, the reward pool) from the same
config, and times what a step does, one phase at a time and then whole steps:

- ``generate``: one generation batch (``data.gen_batch_size`` prompts x ``n``) on the
  engines; generated tokens per second; model FLOPs of decoding.
- ``logprob``: the actor's old-log-prob pass over a training batch; forward FLOPs.
- ``train``: the step's DAPO updates on that batch; forward and backward FLOPs.
- ``sync``: the actor's weights into every engine; GB/s.
- ``reward``: the ``algorithm.reward_fn`` on a mix of long responses on one core
  (:mod:`workloads`), responses per second.
- ``step``: whole steps through the trainer's :class:`~dapo_megatron.run.step.StepRunner`, each
  phase's share of them and the share in no phase (orchestration: Ray calls, batch
  building, memory release); with ``trainer.async_generation`` the next batch is generated
  during training, so phases overlap and only the step time and the wait are reported.

Each phase runs ``warmup`` times unmeasured, then ``steps`` times; the median and the
spread are reported, with the peak memory of the processes involved. Every figure is
also given as a fraction of a ceiling measured in the same run (:mod:`ceilings`), and
on a GPU against the device's published peak (MFU).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from dapo_megatron.bench.ceilings import published_peak
from dapo_megatron.bench.flops import decode_flops, forward_flops, linear_shapes, train_flops
from dapo_megatron.bench.phases import PHASES
from dapo_megatron.bench.workloads import reward_mix
from dapo_megatron.ckpt.mapping import ModelShape
from dapo_megatron.config import Config, ConfigError, engine_routing
from dapo_megatron.runtime.measure import copy_bytes_per_s, peak_memory_bytes, reset_peak_memory

logger = logging.getLogger(__name__)

_NEEDS_DATA = {"generate", "logprob", "train", "step"}
STEP_PHASES = ("generate", "reward", "old_log_prob", "train", "sync")
"""The phases a trainer step times (``time/<phase>`` in its metrics)."""


@dataclass
class BenchOptions:
    """How ``bench`` measures."""

    phases: tuple[str, ...] = PHASES
    """Phases to measure (in :data:`PHASES` order whatever the order given)."""
    steps: int = 3
    """Measured repetitions of each phase."""
    warmup: int = 1
    """Unmeasured repetitions before them (first-call costs, allocator warm-up)."""
    reward_responses: int = 2000
    """Responses in the reward phase's mix."""
    reward_chars: int = 20000
    """Characters of each of them."""
    peak_tflops: Optional[float] = None
    """Per-device dense peak (TFLOP/s) to compute MFU against; default: the published
    figure of the GPU (:data:`~dapo_megatron.bench.ceilings.PUBLISHED_PEAKS`), none on a CPU."""
    peak_tb_per_s: Optional[float] = None
    """Per-device memory bandwidth (TB/s) for the sync's fraction of the published peak."""
    extra: dict = field(default_factory=dict)
    """Free-form notes stored in the JSON (e.g. the command line)."""


def _stats(values: list[float]) -> dict[str, float]:
    median = statistics.median(values)
    return {
        "median": median,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / median if median else 0.0,
        "n": len(values),
    }


def check_phases(phases: list[str]) -> tuple[str, ...]:
    """The requested phases in run order; unknown names are refused, naming the valid ones."""
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise ConfigError(f"--phases: unknown phase(s) {', '.join(unknown)}; choose from {','.join(PHASES)}")
    return tuple(p for p in PHASES if p in phases)


def _devices(config: Config) -> dict[str, int]:
    r = config.rollout
    engine_devices = r.num_engines * (r.engine_tp_size if config.rollout.engine == "sglang" else 1)
    return {"actor": config.parallel.world_size, "engines": engine_devices}


class _Bench:
    """One benchmark run over a started system (see :func:`run_bench`)."""

    def __init__(self, config: Config, options: BenchOptions, system, data) -> None:
        self.config, self.options, self.system = config, options, system
        self.tokenizer, self.loader = data
        self.shape = ModelShape.from_model_config(config.model)
        self.devices = _devices(config)
        self.on_gpu = torch.cuda.is_available() and config.parallel.device != "cpu"
        self.result: dict = {"phases": {}, "ceilings": {}}
        self.batch = None

    # ------------------------------------------------------------------ helpers

    @contextmanager
    def _peak_memory(self, record: dict, engines: bool = True, actor: bool = True):
        """Record the peak memory of the actor's ranks and the engines over the block."""
        if actor:
            self.system.actor.peak_memory(reset=True)
        if engines:
            self.system.engines.peak_memory(reset=True)
        yield
        if actor:
            record["peak_memory_bytes_actor_rank"] = max(self.system.actor.peak_memory())
        if engines:
            # None where an engine cannot measure it (SGLang: its memory is its scheduler
            # processes'): not available, rather than a wrong figure.
            peaks = self.system.engines.peak_memory()
            record["peak_memory_bytes_engine"] = None if None in peaks else max(peaks)

    def _repeat(self, action) -> list[float]:
        """Seconds of ``action()`` after ``warmup`` unmeasured calls, ``steps`` times."""
        for _ in range(self.options.warmup):
            action()
        seconds = []
        for _ in range(self.options.steps):
            start = time.perf_counter()
            action()
            seconds.append(time.perf_counter() - start)
        return seconds

    def _compute(self, record: dict, flops: int, seconds: float, devices: int) -> None:
        """FLOP/s figures of a compute phase, against the matmul ceiling and the peak."""
        achieved = flops / seconds
        record["model_flops"] = flops
        record["flops_per_s"] = achieved
        record["flops_per_s_per_device"] = achieved / devices
        ceiling = self.result["ceilings"].get("matmul_flops_per_s")
        if ceiling:
            record["of_matmul_ceiling"] = achieved / ceiling
        peak = self.result["ceilings"].get("published_peak_flops_per_s_per_device")
        if peak:
            record["mfu"] = achieved / devices / peak

    # ------------------------------------------------------------------ ceilings

    def ceilings(self) -> None:
        """The matmul ceiling on every actor rank at once, the device's published peak."""
        c = self.result["ceilings"]
        tp = self.config.parallel.tp_size
        shapes = linear_shapes(self.shape, tp)
        tokens = self.config.trainer.micro_batch_max_tokens
        per_rank = self.system.actor.matmul_flops_per_s(shapes, tokens)
        c["matmul_flops_per_s_per_rank"] = per_rank
        c["matmul_flops_per_s"] = sum(per_rank)
        c["matmul_shapes"] = {"tokens": tokens, "in_out": shapes}
        c["device"] = torch.cuda.get_device_name() if self.on_gpu else _cpu_name()
        peak = published_peak(c["device"]) if self.on_gpu else None
        tflops = self.options.peak_tflops or (peak.bf16_tflops if peak else None)
        tb_per_s = self.options.peak_tb_per_s or (peak.memory_tb_per_s if peak else None)
        if tflops:
            c["published_peak_flops_per_s_per_device"] = tflops * 1e12
        if tb_per_s:
            c["published_peak_bytes_per_s_per_device"] = tb_per_s * 1e12

    def copy_ceiling(self, num_bytes: int) -> float:
        """Bytes/s of a plain copy of ``num_bytes`` where the engines serve from (measured
        once, in this process: on the CPU it has every core)."""
        c = self.result["ceilings"]
        if "copy_bytes_per_s" not in c:
            device = torch.device("cuda" if self.on_gpu else "cpu")
            c["copy_bytes_per_s"] = copy_bytes_per_s(num_bytes, device)
            c["copy_bytes"] = num_bytes
        return c["copy_bytes_per_s"]

    # ------------------------------------------------------------------ phases

    def _prompts(self, round_index: int):
        from dapo_megatron.sampling.rounds import round_sampling, training_sampling

        d, r = self.config.data, self.config.rollout
        prompts = self.loader.next_batch(d.gen_batch_size or d.train_batch_size)
        sampling = training_sampling(self.config.rollout, self.tokenizer, engine_routing(self.config.model))
        return prompts, round_sampling(sampling, r.seed, 0, round_index, len(prompts), r.n_samples_per_prompt)

    def generate(self, measure: bool) -> None:
        """A generation batch (measured or not), generated and scored as the trainer does;
        keeps the last one's first ``train_batch_size`` groups as the training batch."""
        from dapo_megatron.sampling.episodes import episode_rules
        from dapo_megatron.sampling.rounds import generate_and_score
        from dapo_megatron.sampling.samples import build_policy_batch

        r, d = self.config.rollout, self.config.data
        record: dict = {}
        rounds = iter(range(1_000_000))
        seconds: list[float] = []  # of the generation alone, not the scoring
        last: dict = {}
        episodes = episode_rules(r, self.tokenizer)

        def one() -> None:
            round_index = next(rounds)
            prompts, params = self._prompts(round_index)
            times: dict[str, float] = {}
            last["samples"] = generate_and_score(
                self.system.engines,
                self.system.rewards,
                prompts,
                params,
                r.n_samples_per_prompt,
                round_index,
                self.config.algorithm,
                self.tokenizer,
                times,
                episodes,
            )
            seconds.append(times["generate"])

        if measure:
            with self._peak_memory(record, actor=False):
                self._repeat(one)
        else:
            one()
        samples = last["samples"]
        if measure:
            measured = seconds[self.options.warmup :]
            tokens = sum(len(s.response_ids) for s in samples)
            flops = sum(decode_flops(self.shape, len(s.prompt.token_ids), len(s.response_ids)) for s in samples)
            median = statistics.median(measured)
            record.update(
                seconds=_stats(measured),
                responses=len(samples),
                tokens=tokens,
                tokens_per_s=tokens / median,
                tokens_per_s_per_device=tokens / median / self.devices["engines"],
            )
            self._compute(record, flops, median, self.devices["engines"])
            self.result["phases"]["generate"] = record
        # Whole groups, as many as the trainer's batch holds.
        self.batch = build_policy_batch(samples[: d.train_batch_size * r.n_samples_per_prompt], self.config.algorithm)

    def _actor_phase(self, name: str, action, train: bool, record: dict) -> None:
        """Time ``action`` on the actor; tokens/s and FLOP figures of the batch."""
        with self._peak_memory(record, engines=False):
            seconds = self._repeat(action)
        lengths = self.batch.seq_lengths.tolist()
        logit_tokens = int(self.batch.response_mask().sum())
        flops = (train_flops if train else forward_flops)(self.shape, lengths, logit_tokens)
        tokens, median = int(sum(lengths)), statistics.median(seconds)
        record.update(seconds=_stats(seconds), tokens=tokens, tokens_per_s=tokens / median)
        record["tokens_per_s_per_device"] = tokens / median / self.devices["actor"]
        self._compute(record, flops, median, self.devices["actor"])
        self.result["phases"][name] = record

    def logprob(self) -> None:
        temperature = self.config.rollout.temperature
        out: dict = {}

        def one() -> None:
            out["log_probs"], _ = self.system.actor.compute_log_probs(
                self.batch, temperature, self.batch.num_rows // self.config.data.mini_batch_size
            )

        self._actor_phase("logprob", one, False, {})
        self.batch.old_log_probs = out["log_probs"]

    def train(self) -> None:
        temperature = self.config.rollout.temperature
        num_updates = self.batch.num_rows // self.config.data.mini_batch_size
        if self.batch.old_log_probs is None:
            self.batch.old_log_probs, _ = self.system.actor.compute_log_probs(self.batch, temperature, num_updates)
        if self.config.algorithm.use_kl_loss and self.batch.ref_log_probs is None:
            self.batch.ref_log_probs, _ = self.system.actor.compute_log_probs(
                self.batch, temperature, num_updates, reference=True
            )
        self._actor_phase(
            "train",
            lambda: self.system.actor.train(self.batch, num_updates, temperature),
            True,
            {"updates": num_updates},
        )

    def sync(self) -> None:
        record: dict = {}
        stats = []

        def one() -> None:
            stats.append(self.system.sync_engines(0))

        with self._peak_memory(record):
            self._repeat(one)
        measured = stats[self.options.warmup :]
        seconds = [s.seconds for s in measured]
        num_bytes = measured[0].num_bytes
        engines = self.config.rollout.num_engines
        delivered = num_bytes * engines  # every engine receives the whole model
        median = statistics.median(seconds)
        copy = self.copy_ceiling(delivered)
        record.update(
            seconds=_stats(seconds),
            bytes=num_bytes,
            engines=engines,
            bytes_into_engines=delivered,
            gb_per_s=delivered / median / 1e9,
            of_copy_ceiling=delivered / median / copy,
        )
        peak = self.result["ceilings"].get("published_peak_bytes_per_s_per_device")
        if peak:
            record["of_published_bandwidth"] = delivered / median / peak
        self.result["phases"]["sync"] = record

    def reward(self) -> None:
        """The reward function on one core of this process, and the ceiling of merely
        reading the same text once (UTF-8 encoding every response)."""
        from dapo_megatron.algo.rewards import RewardScorer

        a = self.config.algorithm
        responses, truths = reward_mix(self.options.reward_responses, self.options.reward_chars)
        scorer = RewardScorer(a.reward_fn, a.reward_timeout_s, memory_mb=a.reward_worker_memory_mb)
        record: dict = {"responses": len(responses), "chars_per_response": self.options.reward_chars}
        with _one_core():
            reset_peak_memory(torch.device("cpu"))
            seconds = self._repeat(lambda: scorer.score_batch(responses, truths))
            record["peak_memory_bytes_driver"] = peak_memory_bytes(torch.device("cpu"))
            start = time.perf_counter()
            for text in responses:
                text.encode()
            read_seconds = time.perf_counter() - start
        median = statistics.median(seconds)
        record.update(
            seconds=_stats(seconds),
            responses_per_s=len(responses) / median,
            read_ceiling_responses_per_s=len(responses) / read_seconds,
            of_read_ceiling=read_seconds / median,
        )
        self.result["phases"]["reward"] = record

    def step(self) -> None:
        from dapo_megatron.run.step import StepRunner
        from dapo_megatron.sampling.rounds import training_sampling

        stepper = StepRunner(
            self.system,
            self.loader,
            training_sampling(self.config.rollout, self.tokenizer, engine_routing(self.config.model)),
            self.tokenizer,
        )
        steps: list[dict] = []
        counter = iter(range(1, 1_000_000))
        record: dict = {}
        with self._peak_memory(record):
            self._repeat(lambda: steps.append(stepper.step(next(counter), generate_ahead=True)))
        stepper.close()
        measured = steps[self.options.warmup :]
        total = [m["time/step"] for m in measured]
        record["seconds"] = _stats(total)
        record["asynchronous"] = stepper.asynchronous
        shares = {}
        for phase in (*STEP_PHASES, "wait_for_generation", "outside_phases"):
            values = [m.get(f"time/{phase}", 0.0) for m in measured]
            shares[phase] = {
                "seconds": statistics.median(values),
                "share": statistics.median(v / t for v, t in zip(values, total)),
            }
        record["phases"] = shares
        if stepper.asynchronous:
            # Generating (and scoring) the next batch overlaps the actor's passes: a step
            # can take no less than the longer of the two, plus the sync after both.
            bounds = [
                max(m["time/generate"] + m["time/reward"], m.get("time/old_log_prob", 0.0) + m["time/train"])
                + m["time/sync"]
                for m in measured
            ]
            record["overlap_bound_seconds"] = statistics.median(bounds)
            record["of_ceiling"] = statistics.median(b / t for b, t in zip(bounds, total))
            record["overhead_share"] = None
        else:
            record["overhead_share"] = shares["outside_phases"]["share"]
            record["of_ceiling"] = 1.0 - record["overhead_share"]  # the share of the step that is work
        record["generated_tokens_per_s"] = statistics.median(m["throughput/generate_tokens_per_s"] for m in measured)
        record["train_tokens_per_s"] = statistics.median(m["throughput/train_tokens_per_s"] for m in measured)
        self.result["phases"]["step"] = record


@contextmanager
def _one_core():
    """Pin this thread to one core for the block (where the OS allows it)."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(previous)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores visible)"
    except OSError:
        pass
    return f"CPU ({os.cpu_count()} cores visible)"


def run_bench(config: Config, options: BenchOptions) -> dict:
    """Start the system of ``config``, measure ``options.phases``; the results as a dict
    (what ``--json`` writes)."""
    from dapo_megatron.run.system import load_initial_weights, load_run_data, reference_weights, start_system

    if options.steps < 1 or options.warmup < 0:
        raise ConfigError(f"--steps must be >= 1 and --warmup >= 0 (got {options.steps}, {options.warmup})")
    phases = options.phases
    needs_data = bool(_NEEDS_DATA & set(phases))
    data = (None, None)
    if needs_data:
        tokenizer, _, _, loader = load_run_data(config)
        data = (tokenizer, loader)
    started = time.perf_counter()
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dapo-bench-")))
        system = start_system(config, work, stack)
        load_initial_weights(system.actor, config)
        if (reference := reference_weights(config)) is not None:
            system.actor.load_reference(*reference)
        system.sync_engines(0)  # the engines serve the actor's weights, as in a run
        bench = _Bench(config, options, system, data)
        bench.ceilings()
        if {"logprob", "train"} & set(phases) or "generate" in phases:
            bench.generate(measure="generate" in phases)
        for phase in phases:
            if phase != "generate":
                logger.info("bench: %s", phase)
                getattr(bench, phase)()
    result = bench.result
    result["config"] = {
        "layout": {
            "tp_size": config.parallel.tp_size,
            "pp_size": config.parallel.pp_size,
            "world_size": config.parallel.world_size,
            "device": config.parallel.device,
            "num_engines": config.rollout.num_engines,
            "engine": config.rollout.engine,
            "colocate": config.rollout.colocate,
        },
        "model": {"family": config.model.family, **dataclasses.asdict(ModelShape.from_model_config(config.model))},
        "steps": options.steps,
        "warmup": options.warmup,
        **options.extra,
    }
    result["wall_seconds"] = time.perf_counter() - started
    return result
