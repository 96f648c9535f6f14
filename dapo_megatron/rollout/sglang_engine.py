"""The SGLang rollout engine (GPU): SGLang's offline ``Engine`` behind the rollout interface.

SGLang is imported only when an engine is built, so this module imports on any machine.
Its CUDA kernels do not install on the CPU machines, so this wrapper is checked there by
a contract test that parses the supported SGLang release's source (the wheel, unpacked,
never imported) and verifies that every class, method and keyword argument used below
exists with that name. :data:`SGLANG_API` lists them; the test also checks that the code
calls nothing outside it.

Weight updates, two ways:

- colocated (engine and actor share GPUs): each bucket goes through
  ``Engine.update_weights_from_tensor``; the KV cache is flushed with the last bucket;
- separate GPUs: the engine joins an NCCL group (``init_weights_update_group``) and
  receives each bucket's tensors by broadcast (``update_weights_from_distributed``) while
  the sender broadcasts them in the same order.

SGLang applies every call as it arrives, so unlike the transformers engine an update is
not all-or-nothing across buckets: when a stream fails midway the engine reports itself
unhealthy (``health()['ok'] is False``) until a complete update succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Optional

from dapo_megatron.rollout.engine import (
    Generation,
    RolloutEngine,
    SamplingParams,
    SyncStats,
    WeightBucket,
    WeightSyncError,
    with_last_flag,
)

SUPPORTED_SGLANG = "0.5.23"
"""The SGLang release the wrapper is written and contract-tested against."""

# Everything this module uses from SGLang: {module:qualname: {attribute: keyword args}}.
SGLANG_API: dict[str, dict[str, tuple[str, ...]]] = {
    "sglang.srt.entrypoints.engine:Engine": {
        "generate": ("input_ids", "sampling_params", "return_logprob"),
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
        "release_memory_occupation": ("tags",),
        "resume_memory_occupation": ("tags",),
        "get_server_info": (),
        "shutdown": (),
    },
}
# Engine(**kwargs) goes to ServerArgs; these are the fields passed.
SGLANG_SERVER_ARGS = ("model_path", "tp_size", "mem_fraction_static", "random_seed", "enable_memory_saver", "dtype")
# Keys of SGLang's per-request sampling_params dict used below.
SGLANG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed")


class SGLangRolloutEngine(RolloutEngine):
    """Rollouts with SGLang's offline engine, tensor-parallel over ``tp_size`` GPUs.

    Args:
        model_path: HF checkpoint folder to start from (weights are replaced by syncs).
        tp_size: tensor-parallel size of this engine.
        mem_fraction_static: fraction of GPU memory for weights and KV cache.
        seed: SGLang's random seed.
        dtype: weight dtype (``bfloat16`` for the published recipe).
        enable_memory_saver: needed for release/resume when colocated with the actor.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int = 1,
        mem_fraction_static: float = 0.85,
        seed: int = 1234,
        dtype: str = "bfloat16",
        enable_memory_saver: bool = True,
    ) -> None:
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
            mem_fraction_static=mem_fraction_static,
            random_seed=seed,
            enable_memory_saver=enable_memory_saver,
            dtype=dtype,
        )
        self.released = False
        self.consistent = True
        self.weight_version = 0
        self.last_sync: Optional[SyncStats] = None
        self._session = {"start": 0.0, "bytes": 0, "tensors": 0, "buckets": 0}

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Generation]:
        if not prompts or n < 1:
            raise ValueError(f"need at least one prompt and n >= 1 (got {len(prompts)} prompts, n={n})")
        rows = [prompt for prompt in prompts for _ in range(n)]
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        outputs = self._engine.generate(input_ids=rows, sampling_params=sampling, return_logprob=True)
        results = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            log_probs = [entry[0] for entry in meta["output_token_logprobs"]]
            reason = "length" if meta["finish_reason"]["type"] == "length" else "stop"
            results.append(Generation(i // n, list(out["output_ids"]), log_probs, reason, out.get("text")))
        return results

    def update_weights(self, buckets: Iterable[WeightBucket]) -> SyncStats:
        self.begin_weight_update()
        try:
            for bucket, last in with_last_flag(buckets):
                self.load_weight_bucket(bucket, last)
        except Exception as exc:
            self.abort_weight_update()
            raise WeightSyncError(
                f"SGLang weight update failed after {self._session['tensors']} tensors ({type(exc).__name__}: "
                f"{exc}); the engine's weights are now mixed and it reports unhealthy until a complete update "
                "succeeds"
            ) from exc
        return self.end_weight_update()

    def begin_weight_update(self) -> None:
        self.consistent = False
        self._session = {"start": time.perf_counter(), "bytes": 0, "tensors": 0, "buckets": 0}

    def load_weight_bucket(self, bucket: WeightBucket, last: bool) -> None:
        self._engine.update_weights_from_tensor(named_tensors=bucket.tensors, load_format=None, flush_cache=last)
        self._session["buckets"] += 1
        self._session["tensors"] += len(bucket.tensors)
        self._session["bytes"] += bucket.num_bytes

    def end_weight_update(self) -> SyncStats:
        session = self._session
        self.consistent = True
        self.weight_version += 1
        self.last_sync = SyncStats(
            time.perf_counter() - session["start"], session["bytes"], session["tensors"], session["buckets"]
        )
        return self.last_sync

    def abort_weight_update(self) -> None:
        # SGLang applied what arrived: the weights stay mixed (consistent stays False).
        pass

    def join_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str
    ) -> None:
        """Join the NCCL group a trainer-side sender broadcasts weights over (separate GPUs)."""
        self._engine.init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend="nccl",
        )

    def receive_broadcast_bucket(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, last: bool
    ) -> None:
        """Receive one bucket's tensors by NCCL broadcast; flush the cache after the last."""
        self._engine.update_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=last
        )

    def release_memory(self) -> None:
        self._engine.release_memory_occupation(tags=None)
        self.released = True

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
            "ok": reachable and self.consistent and not self.released,
            "engine": "sglang",
            "released": self.released,
            "weights_consistent": self.consistent,
            "weight_version": self.weight_version,
            "version": info.get("version"),
        }

    def shutdown(self) -> None:
        self._engine.shutdown()
