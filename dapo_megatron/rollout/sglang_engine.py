"""The SGLang rollout engine (GPU): SGLang's offline ``Engine`` behind the rollout interface.

SGLang is imported only when an engine is built, so this module imports on any machine.
Its CUDA kernels do not install on the CPU machines, so this wrapper is checked there by
a contract test that parses the supported SGLang release's source (the wheel, unpacked,
never imported): every class, method and keyword argument used below exists with that
name, each call that answers ``(success, message)`` is checked here, and the session
rule and the other behaviours below are read from that source
(``tests/unit/test_sglang_contract.py``); a stand-in with the same rules runs the wrapper
(``tests/unit/test_sglang_wrapper.py``).

What SGLang 0.5.23 does, and what this wrapper does about it:

- A weight update is a *session*: ``update_weights_from_tensor`` and
  ``update_weights_from_distributed`` load only between ``begin_weight_update()`` and
  ``end_weight_update()`` (``scheduler_components/weight_updater.py``); outside one they
  answer ``(False, "... must run between ...")`` and load nothing. Every update here opens
  the session first and closes it (also after a failure, so the next one can open).
- Weight calls answer ``(success, message)`` instead of raising: each answer is checked
  and a failure raises :class:`WeightSyncError` with SGLang's message.
- ``release_memory_occupation()`` discards the weights unless the server keeps a CPU
  backup (``enable_weights_cpu_backup``, off here: it would hold a second copy of the
  model in host memory): after a release the engine refuses to generate until a complete
  weight update has arrived (the trainer syncs after every resume).
- ``sampling_seed`` is honoured only with ``enable_deterministic_inference`` (else the
  sampler ignores it), and every row of a request with the same seed samples the same
  tokens: each row gets its own seed (the trainer's ``row_seeds``, distinct for every
  step, round, prompt and sample of a run). SGLang's determinism covers one
  engine configuration and batch schedule (its deterministic kernels); runs on other GPU
  counts or SGLang releases differ.
- A request aborted by the server finishes with reason ``abort``: reported as such, and
  the trainer drops its group. Only an abort without an HTTP status comes back as an
  output: one with a status (503 for a request that timed out in the queue, 400 for a
  rejected one) and a request refused on arrival (an input longer than the context)
  *raise* in the tokenizer manager (``ValueError`` for 400, fastapi's ``HTTPException``
  otherwise), and SGLang's batch ``generate`` then fails every row of the batch. So
  every row here is a request of its own (``async_generate``, also for ``generate``),
  and a row SGLang refuses that way is reported as ``abort`` (:func:`request_refusal`);
  any other exception is the engine's failure and raises.
- Streamed generation (``rollout.streaming``) submits each response row as its own
  request (``async_generate`` on the engine's event loop, with a request id of its own)
  and hands back a group once all its rows have returned. An abort is
  ``tokenizer_manager.abort_request(rid=...)`` per row in flight: the scheduler matches
  ids by *prefix* (``req.rid.startswith(rid)``), so every id here has the same width;
  a running request then finishes with ``FINISH_ABORT()`` (no status code), which the
  tokenizer manager returns as a normal output holding the tokens generated so far
  (only aborts with an HTTP status code raise): those are the row's prefix. A request
  that finished in the scheduler before the abort arrived answers with its whole output:
  its group comes back from the abort complete, for the trainer to score. The tokenizer
  manager drops an abort for a request id it holds no state for, so the abort waits
  :attr:`SGLangRolloutEngine.abort_wait_s` at most; a row whose request has not answered
  by then is cancelled and reported as ``abort`` (its group is not trained on).
- ``Engine(...)`` sets ``CUDA_DEVICE_MAX_CONNECTIONS`` and the ``spawn`` start method for
  the whole process: engines are created only in their own worker processes
  (:func:`mark_engine_process`), never in the driver or an actor rank. Each is given its
  GPUs explicitly (``base_gpu_id``): several engines share a node.

Weight updates, two ways: colocated, each bucket goes through
``update_weights_from_tensor`` (the KV cache is flushed with the last bucket) as one
payload per engine TP rank that the feeding actor rank serialized itself, with SGLang's
serializer (CUDA IPC handles naming the GPU by UUID): the whole bucket, packed into a
fresh staging tensor, with each tensor's byte range, in SGLang's ``flattened_bucket``
format (``load_format="flattened_bucket"``: the engine hands the payloads through and
TP rank ``r`` deserializes the ``r``-th). So the staging tensor is shared once per TP
worker and bucket (each share opened once; torch counts its release) and freed after
the bucket, instead of a long-lived buffer being shared once per tensor and worker,
which torch never releases until the buffer is freed (``weight_sync/handles.py``).
The engine's own process never maps the tensors (torch refuses to send on a CUDA tensor
received from another process; ``update_weights_from_tensor`` would have to): it
passes the payloads through to its TP workers, each of which maps the sender's memory
and loads each tensor from its range (no copy of the whole bucket on its own GPU). On separate
GPUs the engine joins an NCCL group (``init_weights_update_group``) and receives each
bucket by broadcast (``update_weights_from_distributed``) while the sender broadcasts the
same tensors in the same order. SGLang applies every call as it arrives, so unlike the
transformers engine an update is not all-or-nothing across buckets: when a stream fails
midway the engine reports itself unhealthy (``health()['ok'] is False``) and refuses to
generate until a complete update succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Optional

import numpy as np
import torch

from dapo_megatron.rollout import routed_experts
from dapo_megatron.rollout.engine import Generation, RolloutEngine, SamplingParams, StreamGroup
from dapo_megatron.rollout.seeds import continuation_seed
from dapo_megatron.weight_sync.bucket import SyncStats, WeightBucket, WeightSyncError, flat_bucket, with_last_flag

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG = "0.5.23"
"""The SGLang release the wrapper is written and contract-tested against."""

# Everything this module uses from SGLang: {module:qualname: {attribute: keyword args}}.
SGLANG_API: dict[str, dict[str, tuple[str, ...]]] = {
    "sglang.srt.entrypoints.engine:Engine": {
        "update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
        "init_weights_update_group": (
            "master_address",
            "master_port",
            "rank_offset",
            "world_size",
            "group_name",
            "backend",
        ),
        "update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "flush_cache"),
        "begin_weight_update": (),
        "end_weight_update": (),
        "release_memory_occupation": ("tags",),
        "resume_memory_occupation": ("tags",),
        "get_server_info": (),
        "shutdown": (),
        "async_generate": ("input_ids", "sampling_params", "return_logprob", "rid", "return_routed_experts"),
    },
    "sglang.srt.managers.tokenizer_manager:TokenizerManager": {
        "abort_request": ("rid",),
    },
}
# Attributes of an Engine instance used below (assigned in its __init__).
SGLANG_ENGINE_ATTRIBUTES = ("loop", "tokenizer_manager")
# The Engine methods that answer (success, message); the wrapper checks every answer.
SGLANG_CHECKED_CALLS = (
    "init_weights_update_group",
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
)
# Engine(**kwargs) goes to ServerArgs; these are the fields passed.
SGLANG_SERVER_ARGS = (
    "model_path",
    "tp_size",
    "base_gpu_id",
    "mem_fraction_static",
    "random_seed",
    "enable_memory_saver",
    "enable_deterministic_inference",
    "dtype",
    "load_format",
    "enable_return_routed_experts",
)
# Keys of SGLang's per-request sampling_params dict used below.
SGLANG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop", "sampling_seed")


ENGINE_PROCESS_ENV = "DAPO_MEGATRON_ENGINE_PROCESS"
"""Set (to the process id) by :func:`mark_engine_process` in a rollout engine's own worker."""


def mark_engine_process() -> None:
    """Declare this process a rollout engine's own (the engine worker calls it first)."""
    os.environ[ENGINE_PROCESS_ENV] = str(os.getpid())


def check_engine_process() -> None:
    """Refuse to create an SGLang engine outside an engine worker's process: its
    constructor changes process-wide settings (``CUDA_DEVICE_MAX_CONNECTIONS``, the
    ``spawn`` start method) that the driver and the actor's ranks must not get."""
    if os.environ.get(ENGINE_PROCESS_ENV) != str(os.getpid()):
        raise RuntimeError(
            "an SGLang engine may only be created in a rollout engine's own process (EngineWorker, which calls "
            "mark_engine_process()): sglang.Engine sets CUDA_DEVICE_MAX_CONNECTIONS and the spawn start method "
            "for the whole process, which would change the driver's or an actor rank's CUDA and multiprocessing "
            "behaviour"
        )


def checked(call: str, answer: Any) -> str:
    """SGLang's ``(success, message)`` answer to ``call``: the message, or
    :class:`WeightSyncError` with it when the call failed (or answered something else)."""
    if not (isinstance(answer, (tuple, list)) and len(answer) >= 2 and isinstance(answer[0], bool)):
        raise WeightSyncError(
            f"SGLang's {call} answered {answer!r}, not (success, message): this wrapper is written against "
            f"sglang=={SUPPORTED_SGLANG}; install that release"
        )
    success, message = answer[0], answer[1]
    if not success:
        raise WeightSyncError(f"SGLang's {call} failed: {message}")
    return str(message)


def sglang_bucket_payload(flat: torch.Tensor, layout) -> bytes:
    """The sender's side of a colocated update (an actor rank): one packed bucket
    (``flat``, its tensors at ``layout``'s byte offsets, see :func:`flat_bucket`)
    as SGLang's ``flattened_bucket`` payload (``FlattenedTensorMetadata`` per tensor),
    serialized for one TP worker with SGLang's ``MultiprocessingSerializer`` after its
    ``monkey_patch_torch_reductions``, so a CUDA tensor is named by device UUID (the
    engine's workers see other device indices than the sender). One CUDA IPC share of
    ``flat``, never the data; ``flat`` must stay alive and unchanged until the engine has
    loaded it."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize(flat_bucket(flat.detach(), layout, FlattenedTensorMetadata))


def row_sampling_params(params: SamplingParams, rows: int) -> list[dict]:
    """SGLang's per-request sampling dicts for ``rows`` rows: each row its own seed
    (``params.row_seeds``, else ``params.seed + row``; one shared seed would give every
    copy of a prompt the same response under deterministic inference). Stop strings go as
    SGLang's ``stop``: its output ids run through the token that completes the string
    (``Req.output_ids_through_stop``, the stop included) with a log-prob each, as the
    transformers engine's do; only its text drops the string, and the trainer decodes the
    ids itself."""
    base = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
    }
    if params.stop_strings:
        base["stop"] = list(params.stop_strings)
    if params.row_seeds is not None:
        if len(params.row_seeds) != rows:
            raise ValueError(f"{len(params.row_seeds)} row seeds for {rows} rows")
        return [{**base, "sampling_seed": seed} for seed in params.row_seeds]
    if params.seed is None:
        return [dict(base) for _ in range(rows)]
    return [{**base, "sampling_seed": params.seed + row} for row in range(rows)]


def stream_request_id(key: int, row: int, length: int) -> str:
    """The request id of a streamed row: fixed width, so that no id is a prefix of
    another (SGLang's abort matches ids by prefix)."""
    return f"dapo-{key:016x}-{row:05d}-{length:08d}"


def request_refusal(exc: BaseException) -> Optional[str]:
    """What SGLang 0.5.23 said when it refused one request by raising rather than answering
    (see the module docstring): the message of a ``ValueError`` (a 400: an input-length or
    parameter rejection, or an abort with status 400) or of an exception carrying an HTTP
    ``status_code`` from 400 to 599 (fastapi's ``HTTPException``: a request that timed out
    in the queue, 503); None for any other exception (the engine failed, not a request)."""
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 600:
        return f"HTTP {status}: {getattr(exc, 'detail', None) or exc}"
    if isinstance(exc, ValueError):
        return f"HTTP 400: {exc}"
    return None


def routed_experts_of_meta(meta: dict, moe_layers: list[bool], num_experts: int) -> Optional[np.ndarray]:
    """SGLang's routed experts of one answer as this project's record
    (``rollout/routed_experts.py``): ``meta_info['routed_experts']`` is base64 of int32
    ``[prompt_tokens + completion_tokens - 1, num_hidden_layers, k]`` (every decoder layer,
    dense ones as zeros; logical expert ids, before any expert-location remapping), sent
    once, when the request finishes or is aborted while running. ``moe_layers``: which
    layers are MoE layers (:func:`~dapo_megatron.config.moe_layers`); only theirs are kept,
    in the smallest integer type that holds an id. None when absent."""
    import base64

    encoded = meta.get("routed_experts")
    if encoded is None:
        return None
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    rows = int(meta["prompt_tokens"]) + int(meta["completion_tokens"]) - 1
    if rows <= 0:
        return None
    if flat.size % (rows * len(moe_layers)):
        raise ValueError(
            f"SGLang sent {flat.size} routed-expert ids for {rows} positions x {len(moe_layers)} layers: "
            "not a whole number of experts per token (an engine serving another model?)"
        )
    routed = flat.reshape(rows, len(moe_layers), -1)
    return routed[:, [i for i, sparse in enumerate(moe_layers) if sparse]].astype(
        routed_experts.routing_dtype(num_experts)
    )


def finish_reason_of(meta: dict) -> str:
    """``stop``, ``length`` or ``abort`` from SGLang's ``meta_info['finish_reason']``."""
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind in ("length", "abort"):
        return kind
    if kind is None:
        # SGLang leaves it unset only for requests that did not finish: treat as aborted.
        return "abort"
    return "stop"  # matched a stop token or string


def _log_refusals(messages: list[str], of: Optional[int] = None) -> None:
    """One warning for the requests SGLang refused in one call: how many, and the first reason."""
    if messages:
        total = f" of {of}" if of is not None else ""
        logger.warning(
            "SGLang refused %d request(s)%s, reported as aborted responses (their groups are not trained on); "
            "the first: %s",
            len(messages),
            total,
            messages[0],
        )


class SGLangRolloutEngine(RolloutEngine):
    """Rollouts with SGLang's offline engine, tensor-parallel over ``tp_size`` GPUs.

    Args:
        model_path: HF checkpoint folder to start from (weights are replaced by syncs).
        tp_size: tensor-parallel size of this engine.
        base_gpu_id: the first of this engine's ``tp_size`` GPUs, among the devices its
            process sees (engines sharing a node get different ones).
        mem_fraction_static: fraction of GPU memory for weights and KV cache.
        seed: SGLang's random seed.
        dtype: weight and activation dtype, SGLang's name (``bfloat16``, ``float32``): the
            actor's parameter dtype (the trainer builds it so), so that a sync copies the
            weights exactly.
        enable_memory_saver: needed for release/resume when colocated with the actor.
        deterministic: SGLang's deterministic inference (honours per-row seeds; slower).
        load_format: SGLang's; ``"dummy"`` allocates the weights without reading them (the
            trainer's engines: the actor's first sync overwrites every weight, and reading a
            32B checkpoint per engine at every start and requeue costs minutes).
        moe_layers: a mixture-of-experts model's layers (True for an MoE layer, as
            :func:`~dapo_megatron.config.moe_layers` gives them) and its number of experts: the engine is started with SGLang's routed-experts
            capture and answers ``return_routed_experts`` requests (``model.routing_replay``).
    """

    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int = 1,
        base_gpu_id: int = 0,
        mem_fraction_static: float = 0.85,
        seed: int = 1234,
        dtype: str = "bfloat16",
        enable_memory_saver: bool = True,
        deterministic: bool = False,
        load_format: str = "auto",
        moe_layers: Optional[tuple[list[bool], int]] = None,
    ) -> None:
        check_engine_process()
        try:
            import sglang
        except ImportError as exc:
            raise ImportError(
                f"the SGLang rollout engine needs sglang=={SUPPORTED_SGLANG} (pip install 'dapo-megatron[gpu]'); "
                "on a machine without a GPU use rollout.engine=hf"
            ) from exc
        self._engine = sglang.Engine(
            model_path=model_path,
            tp_size=tp_size,
            base_gpu_id=base_gpu_id,
            mem_fraction_static=mem_fraction_static,
            random_seed=seed,
            enable_memory_saver=enable_memory_saver,
            enable_deterministic_inference=deterministic,
            dtype=dtype,
            load_format=load_format,
            enable_return_routed_experts=moe_layers is not None,
        )
        self.moe_layers = moe_layers
        self.tp_size = tp_size
        self.released = False
        self.consistent = True
        # Set by a release (SGLang drops the weights) until a complete update arrives.
        self.needs_full_update = False
        self.weight_version = 0
        self.last_sync: Optional[SyncStats] = None
        self._session: Optional[dict] = None
        self._stream_groups: dict[int, StreamGroup] = {}  # streamed groups in flight, by key
        self._stream_tasks: dict[str, tuple] = {}  # request id -> (task, group key, row)
        self._stream_params_route = False  # the streamed requests ask for routed experts

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Generation]:
        if not prompts or n < 1:
            raise ValueError(f"need at least one prompt and n >= 1 (got {len(prompts)} prompts, n={n})")
        self._check_servable()
        rows = [prompt for prompt in prompts for _ in range(n)]
        # One request per row (not SGLang's batch call, where one refused row fails all).
        tasks = [
            self._engine.loop.create_task(
                self._engine.async_generate(
                    input_ids=row,
                    sampling_params=sampling,
                    return_logprob=True,
                    return_routed_experts=self._routing_request(params),
                )
            )
            for row, sampling in zip(rows, row_sampling_params(params, len(rows)))
        ]
        outcomes = self._engine.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        results, refused = [], []
        for i, out in enumerate(outcomes):
            if isinstance(out, BaseException):
                message = request_refusal(out)
                if message is None:
                    raise out
                refused.append(message)
                results.append(Generation(i // n, [], [], "abort"))
                continue
            meta = out["meta_info"]
            log_probs = [entry[0] for entry in meta["output_token_logprobs"]]
            generation = Generation(i // n, list(out["output_ids"]), log_probs, finish_reason_of(meta), out.get("text"))
            if params.return_routed_experts:
                generation.routed_experts = self._routed_experts(meta, len(rows[i]) + len(generation.token_ids) - 1)
            results.append(generation)
        _log_refusals(refused, len(rows))
        return results

    def _routing_request(self, params: SamplingParams) -> bool:
        """Whether the request asks for its routed experts (an engine started without the
        capture refuses: SGLang would silently answer without them)."""
        if params.return_routed_experts and self.moe_layers is None:
            raise ValueError(
                "return_routed_experts: this SGLang engine was started without moe_layers (no routed-experts capture)"
            )
        return params.return_routed_experts

    def _routed_experts(self, meta: dict, positions: int) -> Optional[np.ndarray]:
        """The routing record of an answer (:func:`routed_experts_of_meta`), cut to
        ``positions`` (the tokens kept); None when SGLang sent none (a request aborted
        while it was still queued)."""
        layers, num_experts = self.moe_layers
        return routed_experts.cut(routed_experts_of_meta(meta, layers, num_experts), positions)

    # ------------------------------------------------------------------ streamed generation

    stream_wait_s: float = 1.0
    """The longest one :meth:`stream_step` waits for a request to finish."""

    abort_wait_s: float = 60.0
    """The longest :meth:`stream_abort` waits for the aborted requests to answer (an abort
    takes effect within one scheduler step; SGLang drops one it cannot match). A request
    still running then is cancelled and its row reported as ``abort``."""

    def stream_add(self, groups: list[StreamGroup], params: SamplingParams) -> None:
        """Submit every unfinished row of ``groups`` as a request of its own, continuing
        after the tokens it holds (SGLang's prefix cache reuses the prompt's)."""
        self._check_servable()
        self._stream_params_route = params.return_routed_experts
        for group in groups:
            self._stream_groups[group.key] = group
            for index, row in enumerate(group.rows):
                if row.finish_reason is not None:
                    continue
                rid = stream_request_id(group.key, index, len(row.token_ids))
                sampling = {
                    **row_sampling_params(replace(params, seed=None, row_seeds=None), 1)[0],
                    "max_new_tokens": params.max_new_tokens - len(row.token_ids),
                    "sampling_seed": continuation_seed(row.seed, len(row.token_ids)),
                }
                coroutine = self._engine.async_generate(
                    input_ids=group.prompt_ids + row.token_ids,
                    sampling_params=sampling,
                    return_logprob=True,
                    rid=rid,
                    return_routed_experts=self._routing_request(params),
                )
                self._stream_tasks[rid] = (self._engine.loop.create_task(coroutine), group.key, index)

    def stream_step(self, max_tokens: int, version: int) -> list[StreamGroup]:
        """Wait until a request finishes (at most :attr:`stream_wait_s`; SGLang schedules
        tokens itself, so ``max_tokens`` is not used) and hand back the complete groups."""
        tasks = [task for task, _, _ in self._stream_tasks.values()]
        if tasks:
            self._engine.loop.run_until_complete(
                asyncio.wait(tasks, timeout=self.stream_wait_s, return_when=asyncio.FIRST_COMPLETED)
            )
        self._take_finished(version, aborting=False)
        done = [group for group in self._stream_groups.values() if group.done]
        for group in done:
            del self._stream_groups[group.key]
        return done

    def stream_abort(self, version: int) -> list[StreamGroup]:
        """Abort every request in flight, wait for their outputs (the tokens so far; at
        most :attr:`abort_wait_s`, then the rest are cancelled and their rows reported as
        ``abort``) and hand back every group: the cut ones with those prefixes, and those
        whose requests had all finished before the abort reached them, complete."""
        for rid in self._stream_tasks:
            self._engine.tokenizer_manager.abort_request(rid=rid)
        tasks = [task for task, _, _ in self._stream_tasks.values()]
        if tasks:
            _, pending = self._engine.loop.run_until_complete(asyncio.wait(tasks, timeout=self.abort_wait_s))
            for task in pending:
                task.cancel()
            if pending:
                self._engine.loop.run_until_complete(asyncio.wait(pending))
                logger.warning(
                    "%d SGLang request(s) had not answered %.0f s after their abort (SGLang drops an abort it cannot "
                    "match): cancelled, their rows reported as aborted",
                    len(pending),
                    self.abort_wait_s,
                )
        self._take_finished(version, aborting=True)
        groups, self._stream_groups = list(self._stream_groups.values()), {}
        return groups

    def stream_running(self) -> tuple[int, int]:
        rows = [self._stream_groups[key].rows[index] for _, key, index in self._stream_tasks.values()]
        prompts = [len(self._stream_groups[key].prompt_ids) for _, key, _ in self._stream_tasks.values()]
        return len(rows), sum(prompts) + sum(len(row.token_ids) for row in rows)

    def _take_finished(self, version: int, aborting: bool) -> None:
        """Append each finished request's tokens and log-probs to its row; a row our own
        abort cut stays unfinished (its tokens are a prefix to continue); a row SGLang
        refused (:func:`request_refusal`) or whose abort was lost (cancelled) ends as
        ``abort`` with the tokens it held."""
        refused = []
        for rid, (task, key, index) in list(self._stream_tasks.items()):
            if not task.done():
                continue
            del self._stream_tasks[rid]
            row = self._stream_groups[key].rows[index]
            if task.cancelled():
                row.finish_reason = "abort"
                continue
            if task.exception() is not None:
                message = request_refusal(task.exception())
                if message is None:
                    raise task.exception()
                refused.append(message)
                row.finish_reason = "abort"
                continue
            out = task.result()
            meta = out["meta_info"]
            log_probs = [entry[0] for entry in meta.get("output_token_logprobs") or []]
            ids = list(out["output_ids"])[: len(log_probs)]  # a token without its log-prob is not kept
            row.token_ids += ids
            row.log_probs += log_probs[: len(ids)]
            row.versions += [version] * len(ids)
            if self._stream_params_route:
                prompt = len(self._stream_groups[key].prompt_ids)
                positions = prompt + len(row.token_ids) - 1
                row.routed_experts = routed_experts.extended(row.routed_experts, self._routed_experts(meta, positions))
            reason = finish_reason_of(meta)
            if not (aborting and reason == "abort"):
                row.finish_reason = reason
        _log_refusals(refused)

    def _check_servable(self) -> None:
        if self.released:
            raise RuntimeError("generate() while the engine's memory is released; call resume_memory() first")
        if self.needs_full_update or not self.consistent:
            raise RuntimeError(
                "this SGLang engine holds no complete weights (released without a CPU backup, or an update "
                "failed midway): sync the actor's weights into it before generating"
            )

    def update_weights(self, buckets: Iterable[WeightBucket]) -> SyncStats:
        self.begin_weight_update()
        try:
            for bucket, last in with_last_flag(buckets):
                self.load_weight_bucket(bucket, last)
        except Exception as exc:
            self.abort_weight_update()
            if isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(
                f"SGLang weight update failed after {self._session_count('tensors')} tensors "
                f"({type(exc).__name__}: {exc}); the engine's weights are now mixed and it refuses to generate "
                "until a complete update succeeds"
            ) from exc
        return self.end_weight_update()

    def _session_count(self, key: str) -> int:
        return self._session[key] if self._session is not None else 0

    def begin_weight_update(self) -> None:
        if self._session is not None:
            raise WeightSyncError("a weight update is already open on this SGLang engine; end or abort it first")
        checked("begin_weight_update", self._engine.begin_weight_update())
        self.consistent = False
        self._session = {"start": time.perf_counter(), "bytes": 0, "tensors": 0, "buckets": 0}

    def _require_session(self, what: str) -> dict:
        if self._session is None:
            raise WeightSyncError(f"{what} outside a weight update (begin_weight_update() first)")
        return self._session

    def load_weight_bucket(self, bucket: WeightBucket, last: bool) -> None:
        session = self._require_session("a weight bucket arrived")
        if bucket.offsets:
            raise WeightSyncError("the SGLang engine takes whole HF tensors, not pieces (accepts_pieces is False)")
        checked(
            "update_weights_from_tensor",
            self._engine.update_weights_from_tensor(named_tensors=bucket.tensors, load_format=None, flush_cache=last),
        )
        self._count(session, len(bucket.tensors), bucket.num_bytes)

    accepts_serialized = True
    """Takes buckets as tensors the sender serialized (:meth:`load_serialized_bucket`)."""

    def load_serialized_bucket(self, payloads: list[bytes], num_tensors: int, num_bytes: int, last: bool) -> None:
        """One bucket of the open update as the sender serialized it
        (:func:`sglang_bucket_payload`), one payload per TP worker, handed over in SGLang's
        ``flattened_bucket`` format: the engine passes the list through and worker ``r``
        maps ``payloads[r]`` (no payload is opened twice: torch's CUDA IPC counts every
        share's release) and loads each tensor from its byte range."""
        session = self._require_session("a weight bucket arrived")
        if len(payloads) != self.tp_size:
            raise WeightSyncError(
                f"a serialized bucket of {num_tensors} tensors arrived with {len(payloads)} payload(s) for "
                f"{self.tp_size} TP workers: one each (a CUDA IPC share is opened once); the feeding rank's "
                "readers per engine must be rollout.engine_tp_size"
            )
        checked(
            "update_weights_from_tensor",
            self._engine.update_weights_from_tensor(
                named_tensors=list(payloads), load_format="flattened_bucket", flush_cache=last
            ),
        )
        self._count(session, num_tensors, num_bytes)

    @staticmethod
    def _count(session: dict, tensors: int, num_bytes: int) -> None:
        session["buckets"] += 1
        session["tensors"] += tensors
        session["bytes"] += num_bytes

    def end_weight_update(self) -> SyncStats:
        session = self._require_session("end_weight_update")
        self._session = None
        checked("end_weight_update", self._engine.end_weight_update())
        self.consistent = True
        self.needs_full_update = False
        self.weight_version += 1
        self.last_sync = SyncStats(
            time.perf_counter() - session["start"], session["bytes"], session["tensors"], session["buckets"]
        )
        return self.last_sync

    def abort_weight_update(self) -> None:
        """Close SGLang's session (so the next update can open one); what arrived stays
        loaded, so the weights are mixed: ``consistent`` stays False."""
        if self._session is None:
            return
        self._session = None
        try:
            self._engine.end_weight_update()
        except Exception:  # already failing; the engine stays marked inconsistent
            pass
        self.consistent = False

    def join_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str
    ) -> None:
        """Join the NCCL group a trainer-side sender broadcasts weights over (separate GPUs)."""
        checked(
            "init_weights_update_group",
            self._engine.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend="nccl",
            ),
        )

    def receive_broadcast_bucket(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, last: bool
    ) -> None:
        """Receive one bucket's tensors by NCCL broadcast, inside the open update; flush
        the cache after the last."""
        session = self._require_session("a broadcast bucket was announced")
        checked(
            "update_weights_from_distributed",
            self._engine.update_weights_from_distributed(
                names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=last
            ),
        )
        num_bytes = sum(math.prod(shape) * getattr(torch, dtype).itemsize for dtype, shape in zip(dtypes, shapes))
        self._count(session, len(names), num_bytes)

    def release_memory(self) -> None:
        """Free the GPU memory (SGLang answers nothing here in 0.5.23). The weights are
        gone afterwards: the next generation needs a complete update first."""
        self._engine.release_memory_occupation(tags=None)
        self.released = True
        self.needs_full_update = True

    def resume_memory(self) -> None:
        self._engine.resume_memory_occupation(tags=None)
        self.released = False

    def health(self) -> dict:
        try:
            info = self._engine.get_server_info()
            reachable = True
        except Exception:  # an engine that cannot answer is unhealthy, not a crash
            info, reachable = {}, False
        return {
            "ok": reachable and self.consistent and not self.released and not self.needs_full_update,
            "engine": "sglang",
            "released": self.released,
            "weights_consistent": self.consistent,
            "needs_full_update": self.needs_full_update,
            "weight_version": self.weight_version,
            "version": info.get("version"),
        }

    def shutdown(self) -> None:
        self._engine.shutdown()
