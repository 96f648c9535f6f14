"""Rollout engines as Ray actors, and the one object the trainer generates through.

:class:`RolloutWorkers` starts ``rollout.num_engines`` :class:`EngineWorker` actors (the
transformers engine on the CPU, SGLang on a GPU), spreads each request's prompts over
them in contiguous shares, and returns the responses in prompt order, so the trainer
never knows how many engines there are. Each worker owns one :class:`RolloutEngine` and
exposes its weight-update session to the actor's ranks, which hand buckets over by
handle (:mod:`handles`); the worker maps the bucket and the engine copies it in.

Engines start with placeholder weights: the trainer syncs the actor's weights into them
before the first generation, so actor and engines always hold the same policy.

An engine is built in two phases: the worker process starts, then :meth:`EngineWorker.start`
builds the engine on the GPUs it was given. On a GPU node several engines share the node
(the 32B recipe: 32 engines on 128 GPUs). Colocated engines live in the actor's placement
group and see all of the node's devices (their feeder's CUDA IPC shares name any of
them), so each is told its first GPU (SGLang's ``base_gpu_id``): consecutive
``engine_tp_size`` slots on its node (:func:`colocated_engine_slots`). Separate engines,
and ``eval``'s (no actor), reserve ``engine_tp_size`` whole GPUs and start on the first
of those Ray makes visible.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import ray
import torch

from dapo_megatron.config import Config, engine_routing, moe_layers
from dapo_megatron.models.gpt import params_dtype
from dapo_megatron.orchestration.cluster import separate_cpu_cores
from dapo_megatron.orchestration.group_calls import (
    CONTROL_TIMEOUT_S,
    SHUTDOWN_TIMEOUT_S,
    call_all,
    stop_all,
    unscheduled,
)
from dapo_megatron.orchestration.placement import (
    actor_on_gpu,
    engine_kind,
    engine_placements,
    engine_start_gpus,
)
from dapo_megatron.rollout.engine import Generation, SamplingParams, StreamGroup
from dapo_megatron.rollout.seeds import sampling_seeds
from dapo_megatron.weight_sync.bucket import WeightSyncError

logger = logging.getLogger(__name__)


@ray.remote
class EngineWorker:
    """One rollout engine in its own process."""

    def __init__(
        self,
        config: Config,
        index: int,
        num_threads: int,
        weights_dir: Optional[str] = None,
        cores: Optional[list[int]] = None,
    ) -> None:
        from dapo_megatron.weight_sync.handles import BucketReceiver, use_shareable_cpu_tensors

        if cores:
            from dapo_megatron.orchestration.cluster import pin_process

            pin_process(cores)
        use_shareable_cpu_tensors()
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config, self.index, self.weights_dir = config, index, weights_dir
        self.engine = None
        self.weight_version = -1  # the actor step of the weights last synced in (-1: none yet)
        self.gpus: list[int] = []
        self.receiver = BucketReceiver()

    def start(self, base_gpu_id: Optional[int] = None) -> None:
        """Build the engine (in this process only: SGLang changes process-wide settings);
        on a GPU on ``base_gpu_id`` and the next ``engine_tp_size - 1`` devices, or, when
        None, on the GPUs Ray reserved for this worker (the only ones it sees)."""
        from dapo_megatron.rollout.sglang_engine import mark_engine_process

        mark_engine_process()
        base_gpu_id, self.gpus = engine_start_gpus(self.config, base_gpu_id, [int(i) for i in ray.get_gpu_ids()])
        self.engine = _build_engine(self.config, self.index, self.weights_dir, base_gpu_id or 0)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[Generation]:
        """The engine's responses, each stamped with the weight version it was sampled
        with (the version this worker holds now: a sync cannot run during a generation,
        the worker's calls run one at a time)."""
        version = self.weight_version
        generations = self.engine.generate(prompts, params, n)
        for generation in generations:
            generation.weight_version = version
        return generations

    def stream(self, add: list[StreamGroup], params: SamplingParams, max_tokens: int, abort: bool) -> dict:
        """One tick of streamed generation: take the groups in ``add``, then advance what is
        in flight (the transformers engine: a chunk of up to ``max_tokens`` tokens per row;
        SGLang: until a request finishes) with tokens stamped with this worker's weight
        version, and hand back the groups that completed, or, with ``abort``, stop and hand
        back every group still in the engine (see :meth:`RolloutEngine.stream_abort`: the
        cut ones, and any that completed since the last tick, whole). ``busy_s``: the
        seconds this call took (on SGLang that includes waiting for a request to finish,
        and generation goes on between calls);
        ``running_rows``: the engine's rows still generating; ``running_tokens``: their
        prompts' and tokens so far (the context a chunk reads)."""
        start = time.perf_counter()
        if add:
            self.engine.stream_add(add, params)
        if abort:
            groups = self.engine.stream_abort(self.weight_version)
        else:
            groups = self.engine.stream_step(max_tokens, self.weight_version)
        rows, tokens = self.engine.stream_running()
        return {"groups": groups, "busy_s": time.perf_counter() - start, "running_rows": rows, "running_tokens": tokens}

    def set_weight_version(self, version: int) -> None:
        """Record which actor step the weights just synced in come from."""
        self.weight_version = version

    def node_id(self) -> str:
        """The Ray node this engine runs on (it is fed by an actor rank on the same node)."""
        return ray.get_runtime_context().get_node_id()

    def placement(self) -> tuple[str, list[int]]:
        """The Ray node this engine runs on and its GPUs (none on the CPU)."""
        return self.node_id(), self.gpus

    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    def load_weight_bucket_handle(self, handle, last: bool) -> None:
        """Map the bucket a rank packed (no copy) and let the engine copy it in; an engine
        whose own workers map the tensors (SGLang) gets the sender's serialized bucket
        instead, unopened here."""
        if handle.serialized:
            if not getattr(self.engine, "accepts_serialized", False):
                raise WeightSyncError(
                    f"rollout engine {self.index} ({type(self.engine).__name__}) got a bucket serialized for an "
                    "engine's own workers (SGLang's), which it does not take: the actor serializes buckets only "
                    "when rollout.engine resolves to sglang; check that the actor and the engines agree on it"
                )
            self.engine.load_serialized_bucket(list(handle.serialized), len(handle.layout), handle.num_bytes, last)
            return
        self.engine.load_weight_bucket(self.receiver.open(handle), last)

    def join_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str
    ) -> None:
        """Join the group the actor's rank 0 broadcasts weights over (separate engines)."""
        self.engine.join_weight_update_group(master_address, master_port, rank_offset, world_size, group_name)

    def receive_broadcast_bucket(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, last: bool
    ) -> None:
        """Receive one announced bucket by broadcast (the engine's own receive loop)."""
        self.engine.receive_broadcast_bucket(names, dtypes, shapes, group_name, last)

    def end_weight_update(self) -> dict:
        stats = self.engine.end_weight_update()
        return {"seconds": stats.seconds, "num_bytes": stats.num_bytes}

    def abort_weight_update(self) -> None:
        self.engine.abort_weight_update()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def peak_memory(self, reset: bool) -> Optional[int]:
        """This engine's peak memory since the last reset (then reset it, if ``reset``): the
        transformers engine's, on its device (this process). None for an SGLang engine: its
        weights, KV cache and activations live in SGLang's own scheduler processes, whose
        allocator this process cannot read, and SGLang 0.5.23 reports no peak (only the
        static pool it sized at start); this process's host memory would be a wrong figure."""
        from dapo_megatron.rollout.sglang_engine import SGLangRolloutEngine
        from dapo_megatron.runtime.measure import take_peak_memory

        if isinstance(self.engine, SGLangRolloutEngine):
            return None
        return take_peak_memory(torch.device(getattr(self.engine, "device", "cpu")), reset)

    def health(self) -> dict:
        return {**self.engine.health(), "index": self.index, "pid": os.getpid()}

    def served_weights(self) -> dict[str, torch.Tensor]:
        """The served weights by HF name, by value (tests of small models only; the
        transformers engine's)."""
        from dapo_megatron.rollout.sglang_engine import SGLangRolloutEngine

        if isinstance(self.engine, SGLangRolloutEngine):
            raise NotImplementedError(
                "served_weights reads an engine's weights back, which an SGLang engine cannot do: they live in its "
                "TP workers' processes, and SGLang 0.5.23's Qwen models have no get_weights_by_name; compare "
                "weights on the transformers engine (rollout.engine=hf)"
            )
        return {name: tensor.clone() for name, tensor in self.engine.state_dict().items()}

    def shutdown(self) -> None:
        self.receiver.close()
        self.engine.shutdown()


def _build_engine(config: Config, index: int, weights_dir: Optional[str] = None, base_gpu_id: int = 0):
    """The engine of worker ``index``: with ``weights_dir`` (an HF folder) serving those
    weights; otherwise the trainer's engines, whose weights the actor syncs in. SGLang's
    on ``base_gpu_id`` onwards."""
    rollout = config.rollout
    # The actor's parameter dtype (that of the actor's device, wherever the engine runs),
    # for either engine, so that a sync copies its weights bit for bit (bf16 actor, bf16
    # engine: the train-inference precision of a GPU run; an fp32 actor, fp32 engine).
    dtype = params_dtype(config.model, "cuda" if actor_on_gpu(config.parallel) else "cpu")
    if engine_kind(config) == "hf":
        from dapo_megatron.rollout.hf_engine import HFRolloutEngine, hf_eos_token_ids

        device = "cuda" if torch.cuda.is_available() and config.parallel.device == "cuda" else "cpu"
        folder = config.model.hf_weights_folder
        tokenizer = None
        if rollout.env is not None:  # a multi-turn turn ends on its environment's text
            from dapo_megatron.data import load_tokenizer

            tokenizer = load_tokenizer(config.data, Path(weights_dir) if weights_dir is not None else folder)
        if weights_dir is not None:
            return HFRolloutEngine.from_pretrained(weights_dir, device=device, tokenizer=tokenizer)
        eos = hf_eos_token_ids(folder) if folder is not None else ()
        return HFRolloutEngine.from_model_config(
            config.model, dtype=dtype, device=device, eos_token_ids=eos, tokenizer=tokenizer
        )
    from dapo_megatron.rollout.sglang_engine import SGLangRolloutEngine

    folder = Path(weights_dir) if weights_dir is not None else config.model.hf_weights_folder
    if folder is None:
        raise ValueError("the SGLang engine needs model.hf_weights or model.hf_config (an HF folder to start from)")
    return SGLangRolloutEngine(
        str(folder),
        tp_size=rollout.engine_tp_size,
        base_gpu_id=base_gpu_id,
        mem_fraction_static=rollout.gpu_memory_utilization,
        seed=rollout.seed + index,
        enable_memory_saver=rollout.colocate,
        deterministic=rollout.deterministic_inference,
        dtype=str(dtype).removeprefix("torch."),  # SGLang's names: float32, bfloat16
        # The trainer's engines get every weight from the actor before they generate.
        load_format="auto" if weights_dir is not None else "dummy",
        moe_layers=(moe_layers(config.model), config.model.num_experts) if engine_routing(config.model) else None,
    )


class RolloutWorkers:
    """All rollout engines, driven as one (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        weights_dir: Optional[str] = None,
        start: bool = True,
        placement_group=None,
        engine_actor=None,
    ) -> None:
        """``weights_dir``: an HF folder every engine serves from the start (evaluation);
        without it the engines wait for the actor's weights. With ``start=False`` only the
        engines' processes are asked for (they start and import in the background, e.g.
        while the actor's ranks set up); :meth:`start` then builds the engines.
        ``placement_group``: the actor's, which colocated GPU engines live in (see
        :func:`engine_placements`). ``engine_actor``: the Ray actor class of an engine
        (:class:`EngineWorker`; the placement rehearsal's stand-ins)."""
        self.config = config
        rollout = config.rollout
        on_gpu = engine_kind(config) == "sglang"
        # CPU engines share the machine's cores: oversubscribed OpenMP threads spin and
        # slow every copy and matmul down several times.
        threads = config.ray.engine_num_threads or max(1, (os.cpu_count() or 1) // rollout.num_engines)
        separate = separate_cpu_cores(config)  # engines on cores of their own (async generation)
        engine_cores = separate[1] if separate else [None] * rollout.num_engines
        if separate and not config.ray.engine_num_threads:
            threads = len(engine_cores[0])
        placements = engine_placements(config, placement_group)
        engine_actor = EngineWorker if engine_actor is None else engine_actor
        self.engines = [
            engine_actor.options(**options).remote(
                config, index, 0 if on_gpu else threads, weights_dir, engine_cores[index]
            )
            for index, (options, _) in enumerate(placements)
        ]
        self.names = [f"rollout engine {index}" for index in range(len(self.engines))]
        # A generation call that failed, timed out or was interrupted may still run on its
        # engine: the shutdown then does not wait for the engines' answers.
        self._abandoned = False
        self._start_failed = False  # then engines Ray never placed are not waited for at shutdown
        asked = placements[0][0] if placements else {}
        self._asked = ", ".join(f"{key} {value}" for key, value in asked.items() if key.startswith("num_"))
        if "scheduling_strategy" in asked:
            self._asked += ", inside the actor's placement group"
        self._bases = [base for _, base in placements]
        # Engines that share no device with the actor are built at once; colocated GPU
        # engines only once the actor is up (SGLang sizes its cache from the free memory).
        late = on_gpu and rollout.colocate and placement_group is not None
        self._building = None if late else [e.start.remote(base) for e, base in zip(self.engines, self._bases)]
        if start:
            self.start()

    def start(self, schedule_timeout_s: Optional[float] = None) -> None:
        """Build every engine in its process (on a GPU: on the GPUs it is given) and wait
        until each reports healthy; an engine Ray has not started after
        ``schedule_timeout_s`` (default :data:`SCHEDULE_TIMEOUT_S`) fails it, named."""
        rollout = self.config.rollout
        on_gpu = engine_kind(self.config) == "sglang"
        building = self._building
        placed = {
            "members": self.engines,
            "asked": self._asked,
            "schedule_timeout_s": schedule_timeout_s,
        }  # a start waits for placement, boundedly
        if building is None:  # colocated on GPUs, inside the actor's group: given their GPUs
            building = [engine.start.remote(base) for engine, base in zip(self.engines, self._bases)]
        try:
            call_all(building, "rollout engine", self.names, **placed)
        except BaseException:
            self._start_failed = True
            raise
        health = self.health()
        self.names = [f"rollout engine {h['index']} (pid {h['pid']})" for h in health]
        self._update_ranks = rollout.engine_tp_size if on_gpu else 1
        logger.info("rollout engines up: %d x %s", len(self.engines), rollout.engine)

    @property
    def num_update_ranks(self) -> int:
        """Ranks each engine has in a weight-update group (its tensor-parallel size)."""
        return self._update_ranks

    @property
    def handles(self) -> list:
        """The engines' Ray handles (for the actor's weight sync)."""
        return list(self.engines)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[Generation]:
        """``n`` responses per prompt, in prompt order; prompts spread over the engines.

        Each engine gets a contiguous share and its rows' seeds: ``params.row_seeds``, or,
        for a request with one ``params.seed``, :func:`sampling_seeds` of it (distinct
        for every row whichever engine samples it).
        """
        refs, offsets, names = [], [], []
        for index, start, stop, engine_params in engine_shares(len(prompts), len(self.engines), params, n):
            refs.append(self.engines[index].generate.remote(prompts[start:stop], engine_params, n))
            offsets.append(start)
            names.append(self.names[index])
        results: list[Generation] = []
        for offset, generations in zip(offsets, self._generation(refs, names)):
            for generation in generations:
                generation.prompt_index += offset
                results.append(generation)
        return results

    def stream_tick(
        self, adds: list[list[StreamGroup]], params: SamplingParams, max_tokens: int, abort: bool = False
    ) -> list[dict]:
        """One streamed tick on every engine at once (engine ``i`` takes ``adds[i]``), see
        :meth:`EngineWorker.stream`; each engine's answer, in engine order. The engines
        advance in lockstep, so what comes back depends on the groups alone, never on
        which engine answered first."""
        refs = [engine.stream.remote(add, params, max_tokens, abort) for engine, add in zip(self.engines, adds)]
        return self._generation(refs, self.names)

    def abandon_calls(self) -> None:
        """A generation call another thread waits for is abandoned (a stop): the shutdown
        does not wait for the engines' answers."""
        self._abandoned = True

    def _generation(self, refs: list, names: list[str]) -> list:
        """The engines' answers to a generation call, each within ``rollout.generate_timeout_s``."""
        try:
            return call_all(
                refs,
                "a rollout engine",
                names,
                timeout_s=self.config.rollout.generate_bound_s,
                timeout_key="rollout.generate_timeout_s",
            )
        except BaseException:  # failed, hung or interrupted by a stop: the call may still run
            self._abandoned = True
            raise

    def _control(self, method: str, *args) -> list:
        """Every engine's ``method(*args)``, a call that does no generation, within
        :data:`CONTROL_TIMEOUT_S`."""
        refs = [getattr(engine, method).remote(*args) for engine in self.engines]
        return call_all(refs, "a rollout engine", self.names, timeout_s=CONTROL_TIMEOUT_S)

    def set_weight_version(self, version: int) -> None:
        """Tell every engine the actor step of the weights it now holds (after a sync)."""
        self._control("set_weight_version", version)

    def release_memory(self) -> None:
        self._control("release_memory")

    def resume_memory(self) -> None:
        self._control("resume_memory")

    def peak_memory(self, reset: bool = False) -> list[Optional[int]]:
        """Each engine's peak memory (bytes) since its last reset, None where not available
        (SGLang, see :meth:`EngineWorker.peak_memory`); ``reset`` starts a new one."""
        return self._control("peak_memory", reset)

    def health(self) -> list[dict]:
        return self._control("health")

    def served_weights(self, index: int = 0) -> dict[str, torch.Tensor]:
        """Engine ``index``'s served weights (tests of small models)."""
        return call_all([self.engines[index].served_weights.remote()], "a rollout engine", [self.names[index]])[0]

    def shutdown(self) -> None:
        """Stop every engine (a second call does nothing)."""
        engines, self.engines = self.engines, []
        if self._abandoned:
            stop_all(engines, "rollout engine", timeout_s=0.0)
            return
        unplaced: set[int] = set()
        if self._start_failed:
            # An engine Ray never placed has no process to answer a shutdown (waiting for
            # it would only run out the bound): it is killed at once, first.
            try:
                unplaced = set(unscheduled(list(enumerate(engines))))
            except Exception as exc:  # Ray's state unreadable: wait for every engine, as for a started one
                logger.warning("rollout engine shutdown: cannot tell which engines were never placed: %s", exc)
        stop_all([e for i, e in enumerate(engines) if i in unplaced], "rollout engine", timeout_s=0.0)
        stop_all([e for i, e in enumerate(engines) if i not in unplaced], "rollout engine", SHUTDOWN_TIMEOUT_S)


def engine_shares(num_prompts: int, num_engines: int, params: SamplingParams, n: int) -> list:
    """``(engine index, first prompt, end prompt, its sampling)`` of every engine with
    prompts: contiguous shares, each with its rows' seeds (``params.row_seeds``, or
    :func:`sampling_seeds` of a request's one ``params.seed``)."""
    row_seeds = params.row_seeds
    if row_seeds is None and params.seed is not None:
        row_seeds = sampling_seeds(params.seed, 0, 0, num_prompts, n)
    if row_seeds is not None and len(row_seeds) != num_prompts * n:
        raise ValueError(f"{len(row_seeds)} row seeds for {num_prompts} prompts x {n} samples")
    shares = []
    for index, (start, stop) in enumerate(_split(num_prompts, num_engines)):
        if start == stop:
            continue
        engine_params = params
        if row_seeds is not None:
            engine_params = replace(params, seed=None, row_seeds=tuple(row_seeds[start * n : stop * n]))
        shares.append((index, start, stop, engine_params))
    return shares


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(total)``, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
