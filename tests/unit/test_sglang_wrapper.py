"""The SGLang wrapper's behaviour, run against a stand-in for SGLang 0.5.23's ``Engine``.

The stand-in follows the rules ``test_sglang_contract.py`` reads from the release's
source: weight updates load only inside a begin/end session and answer ``(False,
message)`` outside one; begin refuses an open session and end a missing one; a failed
load answers ``(False, message)``; release discards the weights (no CPU backup); each
request row's ``sampling_seed`` is what it samples with; a finish reason is a dict with a
``type``. What these tests show: every weight actually reaches the engine inside a
session, every failure raises with SGLang's message, a released or half-updated engine
refuses to generate until a complete update, seeds differ per row, aborted rows are
reported as such (also a request SGLang rejects with an HTTP status, which it raises
instead of returning), an abort's wait is bounded, a group that finished while the abort
was on its way comes back whole, the engine is built in the actor's dtype, and an engine
is only built in an engine process.
"""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import types

import numpy as np
import pytest
import torch

from dapo_megatron.rollout import sglang_engine
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.rollout.sglang_engine import SGLangRolloutEngine, row_sampling_params
from dapo_megatron.weight_sync.bucket import WeightBucket, WeightSyncError


class StandInEngine:
    """SGLang 0.5.23's Engine as far as the wrapper uses it (see the module docstring)."""

    def __init__(self, **server_args) -> None:
        self.server_args = server_args
        self.session = False
        self.weights: dict[str, torch.Tensor] = {"w": torch.zeros(2)}
        self.requests: list = []
        self.fail_on: set[str] = set()
        self.finish = None  # a fixed output ([3, 1] with this reason) instead of streaming tokens
        self.reject: dict[int, Exception] = {}  # sampling seed -> what SGLang raises for that request
        self.lost_aborts: set[int] = set()  # seeds whose abort SGLang drops: they run to their limit
        self.finished_at_abort: set[int] = set()  # seeds whose request had finished when the abort came
        self.group = None
        self.received: list = []
        self.answers = 0
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = StandInTokenizerManager()
        self.streamed: list = []  # (rid, input_ids, sampling_params) of every async_generate

    async def async_generate(self, input_ids, sampling_params, return_logprob, rid=None, return_routed_experts=False):
        """One token (id 5) per millisecond up to max_new_tokens ("length"), or, once
        ``rid`` is aborted, the tokens so far with SGLang's plain abort reason. A request
        whose seed is in ``reject`` raises that exception (as the tokenizer manager does for
        an input-length rejection or an abort with an HTTP status); one in ``lost_aborts``
        ignores its abort; one in ``finished_at_abort`` has all its tokens once aborted (it
        finished in the scheduler before the abort was read). With ``return_routed_experts``
        (and the server's capture on), the answer carries SGLang 0.5.23's record: base64 of
        int32 ``[prompt + completion - 1, 3 layers, 2]``, position ``p`` of layer ``l``
        routed to ``(p + l + version) % 4`` and ``(p + l + version + 1) % 4``, where
        ``version`` counts this engine's answers (another answer: other weights)."""
        self.streamed.append((rid, list(input_ids), dict(sampling_params)))
        answer = await self._generate(input_ids, sampling_params, rid)
        if return_routed_experts and self.server_args.get("enable_return_routed_experts"):
            meta = answer["meta_info"]
            meta["prompt_tokens"], meta["completion_tokens"] = len(input_ids), len(answer["output_ids"])
            positions = torch.arange(len(input_ids) + len(answer["output_ids"]) - 1)[:, None, None]
            routed = (positions + torch.arange(3)[None, :, None] + torch.arange(2) + self.answers) % 4
            meta["routed_experts"] = base64.b64encode(routed.to(torch.int32).numpy().tobytes()).decode()
        self.answers += 1
        return answer

    async def _generate(self, input_ids, sampling_params, rid):
        seed = sampling_params.get("sampling_seed")
        if seed in self.reject:
            await asyncio.sleep(0.001)
            raise self.reject[seed]
        if self.finish is not None:
            await asyncio.sleep(0)
            return {
                "output_ids": [3, 1],
                "meta_info": {"output_token_logprobs": [(-0.5, 3), (-0.1, 1)], "finish_reason": self.finish},
            }
        ids = []
        limit = sampling_params["max_new_tokens"]
        while len(ids) < limit:
            if rid in self.tokenizer_manager.aborted and seed in self.finished_at_abort:
                ids += [5] * (limit - len(ids))
                break
            if rid in self.tokenizer_manager.aborted and seed not in self.lost_aborts:
                break
            await asyncio.sleep(0.001)
            ids.append(5)
        reason = (
            {"type": "abort", "message": "Aborted", "status_code": None}
            if len(ids) < sampling_params["max_new_tokens"]
            else {"type": "length", "length": len(ids)}
        )
        return {
            "output_ids": ids,
            "meta_info": {"output_token_logprobs": [(-0.25, 5)] * len(ids), "finish_reason": reason},
        }

    def begin_weight_update(self):
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if not self.session:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        for name, tensor in named_tensors:
            if name in self.fail_on:
                return False, f"Failed to update weights: unknown parameter {name}"
            self.weights[name] = tensor.clone()
        return True, "Success"

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        self.group = (master_address, master_port, rank_offset, world_size, group_name, backend)
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, flush_cache=True):
        if not self.session:
            return (
                False,
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
            )
        if self.group is None or self.group[4] != group_name:
            return False, f"Failed to receive weights: no group {group_name}"
        self.received.append((names, flush_cache))
        return True, "Succeeded to update parameter online."

    def release_memory_occupation(self, tags=None):
        self.weights = {}  # memory saver pauses the weights; no CPU backup

    def resume_memory_occupation(self, tags=None):
        pass  # the memory comes back, not its contents

    def generate(self, input_ids, sampling_params, return_logprob):
        """The batch call: one rejected request fails the whole batch (SGLang gathers the
        rows' outputs and the first exception propagates)."""
        self.requests.append(sampling_params)
        for params in sampling_params:
            if params.get("sampling_seed") in self.reject:
                raise self.reject[params["sampling_seed"]]
        return [
            {
                "output_ids": [3, 1],
                "meta_info": {"output_token_logprobs": [(-0.5, 3), (-0.1, 1)], "finish_reason": self.finish},
            }
            for _ in input_ids
        ]

    def get_server_info(self):
        return {"version": "0.5.23"}

    def shutdown(self):
        pass


class StandInTokenizerManager:
    def __init__(self) -> None:
        self.aborted: set[str] = set()

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.aborted.add(rid)


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=StandInEngine))
    monkeypatch.setenv(sglang_engine.ENGINE_PROCESS_ENV, str(os.getpid()))
    return SGLangRolloutEngine("/model", tp_size=2, base_gpu_id=4)


def buckets(*names):
    return [WeightBucket([(name, torch.full((2,), float(i)))]) for i, name in enumerate(names)]


def test_an_update_arrives_inside_a_session(engine):
    assert engine._engine.server_args["base_gpu_id"] == 4 and engine._engine.server_args["tp_size"] == 2
    stats = engine.update_weights(buckets("a", "b"))
    assert not engine._engine.session  # closed again
    assert torch.equal(engine._engine.weights["b"], torch.full((2,), 1.0))
    assert (stats.num_tensors, stats.num_buckets, stats.num_bytes) == (2, 2, 16)
    assert engine.health()["ok"] and engine.weight_version == 1


def test_buckets_outside_an_update_are_refused(engine):
    with pytest.raises(WeightSyncError, match="outside a weight update"):
        engine.load_weight_bucket(buckets("a")[0], True)
    with pytest.raises(WeightSyncError, match="outside a weight update"):
        engine.receive_broadcast_bucket(["a"], ["float32"], [[2]], "g", True)


def test_a_broadcast_update_runs_inside_a_session(engine):
    engine.join_weight_update_group("10.0.0.1", 29500, 1, 3, "g")
    assert engine._engine.group == ("10.0.0.1", 29500, 1, 3, "g", "nccl")
    engine.begin_weight_update()
    engine.receive_broadcast_bucket(["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]], "g", True)
    stats = engine.end_weight_update()
    assert engine._engine.received == [(["a", "b"], True)]
    assert (stats.num_tensors, stats.num_bytes) == (2, 2 * 6 + 4 * 4) and not engine._engine.session
    engine._engine.group = None
    engine.begin_weight_update()
    with pytest.raises(WeightSyncError, match="no group g"):
        engine.receive_broadcast_bucket(["a"], ["float32"], [[2]], "g", True)


def test_a_failed_load_raises_closes_the_session_and_blocks_generation(engine):
    engine._engine.fail_on = {"b"}
    with pytest.raises(WeightSyncError, match="unknown parameter b"):
        engine.update_weights(buckets("a", "b"))
    assert not engine._engine.session  # the next update can open one
    assert not engine.health()["ok"]
    with pytest.raises(RuntimeError, match="no complete weights"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    engine._engine.fail_on = set()
    engine.update_weights(buckets("a", "b"))
    assert engine.health()["ok"] and len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))) == 1


def test_a_second_open_session_is_refused(engine):
    engine.begin_weight_update()
    with pytest.raises(WeightSyncError, match="already open"):
        engine.begin_weight_update()


def test_release_needs_a_full_update_before_generating(engine):
    engine.update_weights(buckets("w"))
    engine.release_memory()
    engine.resume_memory()
    assert engine._engine.weights == {}  # what SGLang keeps: nothing
    assert engine.health()["needs_full_update"] and not engine.health()["ok"]
    with pytest.raises(RuntimeError, match="sync the actor's weights"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
    engine.update_weights(buckets("w"))
    assert engine.health()["ok"]
    engine.generate([[1]], SamplingParams(max_new_tokens=2))


def test_every_row_samples_with_its_own_seed(engine):
    engine.update_weights(buckets("w"))
    engine.generate([[1], [2]], SamplingParams(max_new_tokens=2, seed=100), n=3)
    assert sent_seeds(engine) == [100, 101, 102, 103, 104, 105]
    assert all("sampling_seed" not in row for row in row_sampling_params(SamplingParams(), 2))


def sent_seeds(engine) -> list:
    """The seeds of the last generate() call's rows, whichever SGLang call carried them."""
    if engine._engine.requests:
        return [row["sampling_seed"] for row in engine._engine.requests[-1]]
    return [sampling["sampling_seed"] for _, _, sampling in engine._engine.streamed]


def test_abort_is_reported_as_abort(engine):
    engine.update_weights(buckets("w"))
    engine._engine.finish = {"type": "stop", "matched": 1}
    assert engine.generate([[1]], SamplingParams(max_new_tokens=2))[0].finish_reason == "stop"
    engine._engine.finish = {"type": "abort", "message": "Aborted"}
    assert engine.generate([[1]], SamplingParams(max_new_tokens=2))[0].finish_reason == "abort"
    engine._engine.finish = {"type": "length", "length": 2}
    assert engine.generate([[1]], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"


def test_an_engine_is_built_only_in_an_engine_process(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=StandInEngine))
    monkeypatch.delenv(sglang_engine.ENGINE_PROCESS_ENV, raising=False)
    with pytest.raises(RuntimeError, match="only be created in a rollout engine's own process"):
        SGLangRolloutEngine("/model")
    monkeypatch.setenv(sglang_engine.ENGINE_PROCESS_ENV, str(os.getpid() + 1))  # inherited by a child: not it
    with pytest.raises(RuntimeError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        SGLangRolloutEngine("/model")


def test_the_trainers_engines_skip_reading_weights_the_sync_overwrites(monkeypatch, tmp_path):
    from dapo_megatron.config import config_from_dict
    from dapo_megatron.orchestration.rollout import _build_engine
    from tests.distributed.actor_worker import tiny_hf_qwen2

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=StandInEngine))
    monkeypatch.setenv(sglang_engine.ENGINE_PROCESS_ENV, str(os.getpid()))
    tiny_hf_qwen2(tied=False, seed=0).config.save_pretrained(tmp_path / "model")
    config = config_from_dict(
        {"model": {"hf_config": str(tmp_path / "model")}, "rollout": {"engine": "sglang", "engine_tp_size": 1}}
    )
    trainers = _build_engine(config, 0)
    assert trainers._engine.server_args["load_format"] == "dummy"
    assert trainers._engine.server_args["model_path"] == str(tmp_path / "model")
    evaluations = _build_engine(config, 0, weights_dir=str(tmp_path / "model"))  # eval serves the folder's weights
    assert evaluations._engine.server_args["load_format"] == "auto"


def _payload(flat, layout) -> bytes:
    """What ``sglang_bucket_payload`` sends, without SGLang: the flattened bucket pickled
    by torch's ForkingPickler (as SGLang's MultiprocessingSerializer does)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    from dapo_megatron.weight_sync.bucket import flat_bucket

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(flat_bucket(flat, layout))
    return buffer.getvalue()


def test_colocated_buckets_reach_every_tp_worker_as_the_senders_flattened_bucket(engine):
    """The actor rank packs a bucket and serializes it, whole, once per TP worker; the
    engine worker passes the payloads through unopened with load_format
    "flattened_bucket"; each of the engine's 2 TP workers deserializes its own (SGLang's
    deserialize_own_rank) and reads each tensor from its byte range: the sender's tensors."""
    import pickle

    from dapo_megatron.weight_sync.bucket import unflatten_bucket
    from dapo_megatron.weight_sync.handles import SharedBucketBuffer

    loaded = {}

    def update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True):
        assert engine._engine.session and load_format == "flattened_bucket" and len(named_tensors) == 2
        for rank in range(2):  # each TP worker's own payload
            for name, tensor in unflatten_bucket(pickle.loads(named_tensors[rank])):
                loaded.setdefault(name, []).append(tensor.clone())
        return True, "Success"

    engine._engine.update_weights_from_tensor = update_weights_from_tensor
    sent = {"q": torch.randn(3, 4), "b": torch.arange(5.0).to(torch.bfloat16)}
    buffer = SharedBucketBuffer(torch.device("cpu"))
    handle = buffer.pack(WeightBucket(list(sent.items())), _payload, readers=2)
    assert len(handle.serialized) == 2 and handle.buffers == ()  # one payload per worker, no other handle
    engine.begin_weight_update()
    engine.load_serialized_bucket(list(handle.serialized), len(handle.layout), handle.num_bytes, True)
    stats = engine.end_weight_update()
    assert set(loaded) == set(sent) and (stats.num_tensors, stats.num_bytes) == (2, 12 * 4 + 5 * 2)
    for name, tensor in sent.items():
        assert len(loaded[name]) == 2 and all(torch.equal(copy, tensor) for copy in loaded[name])
    # One payload for both TP workers (a share opened twice) is refused.
    with pytest.raises(WeightSyncError, match=r"arrived with 1 payload\(s\) for 2 TP workers: one each"):
        engine.begin_weight_update()
        engine.load_serialized_bucket(list(handle.serialized[:1]), 2, 0, True)
    engine.abort_weight_update()
    buffer.close()


def test_every_cuda_ipc_share_is_opened_by_exactly_one_tp_worker(monkeypatch):
    """A feeder rank streams 3 buckets by handle to 2 engines of TP 4: every payload it
    serializes (a share) is opened once, by one TP worker of one engine, and every worker
    gets every bucket; one share per bucket and worker (24), not one per tensor and
    worker. Stand-in readers take the engine worker's path."""
    from dapo_megatron.orchestration import actor_group
    from dapo_megatron.weight_sync.handles import SharedBucketBuffer

    shares: list[bytes] = []
    layouts: dict[bytes, list[str]] = {}

    def serialize(flat, layout):  # one new share per call, as torch's CUDA IPC reduction makes
        shares.append(f"share {len(shares)}".encode())
        layouts[shares[-1]] = [name for name, *_ in layout]
        return shares[-1]

    opened: list[tuple[int, int, bytes]] = []

    class Reader:
        """An engine: its TP worker r opens payload r (SGLang's deserialize_own_rank)."""

        def __init__(self, index, tp):
            self.index, self.tp = index, tp
            outer = self

            class _Call:
                @staticmethod
                def remote(handle, last):
                    assert len(handle.serialized) == outer.tp
                    for rank in range(outer.tp):
                        opened.append((outer.index, rank, handle.serialized[rank]))
                    return None

            self.load_weight_bucket_handle = _Call()

    monkeypatch.setattr(actor_group, "_await_engines", lambda refs, bound_s, names=None: refs)
    buckets = [WeightBucket([(f"t{b}.{i}", torch.randn(4)) for i in range(2)]) for b in range(3)]
    buffers = [SharedBucketBuffer(torch.device("cpu")) for _ in range(2)]
    engines = [Reader(0, 4), Reader(1, 4)]
    sent = actor_group._stream_by_handle(
        iter(buckets), buffers, engines, 60.0, serialize=serialize, readers_per_engine=4
    )
    assert sent[1:] == (6, 3)
    assert len(shares) == 3 * 2 * 4  # buckets x engines x TP workers: no share nobody opens
    assert sorted(payload for *_, payload in opened) == sorted(shares)  # each opened exactly once
    for engine_index in range(2):
        for rank in range(4):
            names = [name for e, r, payload in opened if (e, r) == (engine_index, rank) for name in layouts[payload]]
            assert names == [f"t{b}.{i}" for b in range(3) for i in range(2)]
    for buffer in buffers:
        buffer.close()


def test_streamed_rows_are_requests_of_their_own_and_come_back_as_groups(engine):
    from dapo_megatron.rollout.engine import StreamGroup, StreamRow

    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    engine.stream_add([StreamGroup(7, [1, 2], [StreamRow(11), StreamRow(12)])], params)
    done = []
    while not done:
        done = engine.stream_step(64, version=4)
    (group,) = done
    assert [row.token_ids for row in group.rows] == [[5, 5, 5]] * 2
    assert all(row.finish_reason == "length" and row.versions == [4] * 3 for row in group.rows)
    seeds = [sampling["sampling_seed"] for _, _, sampling in engine._engine.streamed]
    assert seeds == [11, 12]  # a row's own seed while it holds no tokens


def test_an_abort_hands_back_prefixes_that_continue_as_new_requests(engine):
    from dapo_megatron.rollout.engine import StreamGroup, StreamRow
    from dapo_megatron.rollout.seeds import continuation_seed

    engine.stream_wait_s = 0.02
    params = SamplingParams(temperature=1.0, max_new_tokens=10_000)
    engine.stream_add([StreamGroup(3, [1, 2], [StreamRow(11), StreamRow(12, [9], [-1.0], [0])])], params)
    assert engine.stream_step(64, version=1) == []
    (cut,) = engine.stream_abort(version=1)
    assert all(row.finish_reason is None for row in cut.rows)
    held = [len(row.token_ids) for row in cut.rows]
    assert held[0] > 0 and held[1] > 1 and cut.rows[1].token_ids[0] == 9 and cut.rows[1].versions[0] == 0
    assert all(set(row.versions[1:]) == {1} for row in cut.rows)
    rids = [rid for rid, _, _ in engine._engine.streamed]
    assert engine._engine.tokenizer_manager.aborted == set(rids)  # every request in flight, by its own id
    engine.stream_add([cut], params)
    assert engine.stream_step(64, version=2) == []  # the requests start on the engine's loop
    (rid, input_ids, sampling), _ = engine._engine.streamed[2:]
    assert input_ids == [1, 2] + cut.rows[0].token_ids  # the prompt and the prefix
    assert sampling["max_new_tokens"] == 10_000 - held[0]
    assert sampling["sampling_seed"] == continuation_seed(11, held[0]) and rid not in rids
    engine.stream_abort(version=2)


class HTTPException(Exception):
    """fastapi's HTTPException as SGLang raises it (``status_code`` and ``detail``)."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code, self.detail = status_code, detail


TOO_LONG = ValueError("Requested token count exceeds the model's maximum context length of 32 tokens.")
TIMED_OUT = HTTPException(503, "The request timed out in the waiting queue.")


def test_a_request_sglang_rejects_with_an_http_status_is_an_aborted_row_not_a_failed_round(engine):
    """SGLang 0.5.23 raises for an abort that carries an HTTP status (400: ValueError,
    else fastapi's HTTPException) and for an input-length rejection, and its batch call
    then fails every row: each row is its own request, and a rejected one comes back as
    ``abort`` (its group is not trained on) while the others keep their responses."""
    engine.update_weights(buckets("w"))
    engine._engine.reject = {101: TOO_LONG, 104: TIMED_OUT}
    results = engine.generate([[1], [2]], SamplingParams(max_new_tokens=2, seed=100), n=3)
    assert [r.finish_reason for r in results] == ["length", "abort", "length", "length", "abort", "length"]
    assert [len(r.token_ids) for r in results] == [2, 0, 2, 2, 0, 2]
    assert [r.prompt_index for r in results] == [0, 0, 0, 1, 1, 1]
    # Anything else is a failure of the engine, not of one request: it still raises.
    engine._engine.reject = {102: RuntimeError("scheduler died")}
    with pytest.raises(RuntimeError, match="scheduler died"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2, seed=100), n=3)


def test_a_streamed_row_sglang_rejects_ends_its_group_as_aborted(engine):
    from dapo_megatron.rollout.engine import StreamGroup, StreamRow

    engine._engine.reject = {12: TIMED_OUT, 21: TOO_LONG}
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    groups = [StreamGroup(1, [1, 2], [StreamRow(11), StreamRow(12)]), StreamGroup(2, [1], [StreamRow(21)])]
    engine.stream_add(groups, params)
    done = []
    for _ in range(100):
        done += engine.stream_step(64, version=4)
        if len(done) == 2:
            break
    first, second = sorted(done, key=lambda g: g.key)
    assert [row.finish_reason for row in first.rows] == ["length", "abort"]
    assert first.rows[0].token_ids == [5, 5, 5] and first.rows[1].token_ids == []
    assert [row.finish_reason for row in second.rows] == ["abort"]
    engine._engine.reject = {31: RuntimeError("scheduler died")}
    engine.stream_add([StreamGroup(3, [1], [StreamRow(31)])], params)
    with pytest.raises(RuntimeError, match="scheduler died"):
        for _ in range(100):
            engine.stream_step(64, version=4)


def test_an_abort_waits_a_bounded_time_and_a_lost_one_ends_its_row(engine):
    """SGLang drops an abort for a request id it holds no state for: that request runs on
    to its limit. The abort waits ``abort_wait_s`` at most; the row it lost is reported as
    ``abort`` (never continued under the same request id), the others as cut prefixes."""
    import time

    from dapo_megatron.rollout.engine import StreamGroup, StreamRow

    engine.stream_wait_s, engine.abort_wait_s = 0.02, 0.2
    engine._engine.lost_aborts = {12}
    params = SamplingParams(temperature=1.0, max_new_tokens=5_000)  # 5 s at a token per ms
    engine.stream_add([StreamGroup(1, [1, 2], [StreamRow(11), StreamRow(12)])], params)
    assert engine.stream_step(64, version=1) == []
    start = time.perf_counter()
    (cut,) = engine.stream_abort(version=1)
    assert time.perf_counter() - start < 2.0
    assert cut.rows[0].finish_reason is None and cut.rows[0].token_ids  # a prefix to continue
    assert cut.rows[1].finish_reason == "abort" and len(cut.rows[1].token_ids) < 5_000
    assert engine.stream_running() == (0, 0)


def test_a_group_that_finished_before_the_abort_was_read_comes_back_whole(engine):
    """A request can finish in the scheduler between the last step and the abort (SGLang
    then answers it with its full output and reason ``length``/``stop``): its group comes
    back from the abort complete (``done``), for the sampler to score, and the cut group
    as a prefix."""
    from dapo_megatron.rollout.engine import StreamGroup, StreamRow

    engine.stream_wait_s = 0.02
    engine._engine.finished_at_abort = {11, 12}
    params = SamplingParams(temperature=1.0, max_new_tokens=2_000)
    engine.stream_add(
        [StreamGroup(1, [1], [StreamRow(11), StreamRow(12)]), StreamGroup(2, [1], [StreamRow(21)])], params
    )
    assert engine.stream_step(64, version=3) == []
    back = {g.key: g for g in engine.stream_abort(version=3)}
    assert back[1].done and [row.finish_reason for row in back[1].rows] == ["length", "length"]
    assert all(len(row.token_ids) == 2_000 and row.versions == [3] * 2_000 for row in back[1].rows)
    assert not back[2].done and back[2].rows[0].finish_reason is None


@pytest.mark.parametrize(
    ("params_dtype", "device", "served"),
    [
        ("float32", "cuda", "float32"),
        ("bfloat16", "cuda", "bfloat16"),
        ("auto", "cuda", "bfloat16"),
        ("float32", "auto", "float32"),
    ],
)
def test_the_sglang_engine_is_built_in_the_actors_dtype(monkeypatch, tmp_path, params_dtype, device, served):
    from dapo_megatron.config import config_from_dict
    from dapo_megatron.orchestration.rollout import _build_engine
    from tests.distributed.actor_worker import tiny_hf_qwen2

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=StandInEngine))
    monkeypatch.setenv(sglang_engine.ENGINE_PROCESS_ENV, str(os.getpid()))
    tiny_hf_qwen2(tied=False, seed=0).config.save_pretrained(tmp_path / "model")
    config = config_from_dict(
        {
            "model": {"hf_config": str(tmp_path / "model"), "params_dtype": params_dtype},
            "parallel": {"device": device},
            "rollout": {"engine": "sglang", "engine_tp_size": 1},
        }
    )
    assert _build_engine(config, 0)._engine.server_args["dtype"] == served


def test_an_sglang_engine_reports_no_peak_memory_and_refuses_to_export_its_weights(engine, monkeypatch):
    """Its GPU memory is held by SGLang's scheduler processes, not the worker's: the peak is
    reported as not available (None), never the worker's host memory; and SGLang 0.5.23's
    Qwen models cannot hand their weights back (no get_weights_by_name): served_weights
    says so instead of calling a method the engine lacks."""
    from dapo_megatron.orchestration.rollout import EngineWorker

    worker = types.SimpleNamespace(engine=engine)
    cls = EngineWorker.__ray_actor_class__  # the class the Ray actor runs, undecorated
    assert cls.peak_memory(worker, True) is None
    with pytest.raises(NotImplementedError, match="SGLang engine.*rollout.engine=hf"):
        cls.served_weights(worker)
    # bench's table says so instead of a number.
    from dapo_megatron.bench.report import _row

    record = {
        "seconds": {"median": 1.0, "spread": 0.0},
        "tokens_per_s": 10.0,
        "tokens_per_s_per_device": 10.0,
        "peak_memory_bytes_actor_rank": 3 * 2**30,
        "peak_memory_bytes_engine": None,
    }
    assert _row("generate", record)[4] == "3.00 GiB (engines: n/a)"
    assert _row("generate", {**record, "peak_memory_bytes_engine": 5 * 2**30})[4] == "5.00 GiB"


def routed(positions: range, answer: int) -> torch.Tensor:
    """The stand-in's record of ``positions`` in its ``answer``-th answer, MoE layers 0 and 2."""
    p = torch.tensor(list(positions))[:, None, None]
    return ((p + torch.tensor([0, 2])[None, :, None] + torch.arange(2) + answer) % 4).to(torch.uint8).numpy()


def test_routed_experts_of_a_row_cut_and_continued_keep_each_position_of_its_first_answer(monkeypatch):
    """Layers 0 and 2 of 3 are MoE layers: the record keeps theirs. A row aborted and
    continued keeps the routing its prefix was sampled with; the continuation adds only
    the positions after it. An engine started without the capture refuses such a request
    (SGLang would answer without them)."""
    from dapo_megatron.rollout.engine import StreamGroup, StreamRow

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=StandInEngine))
    monkeypatch.setenv(sglang_engine.ENGINE_PROCESS_ENV, str(os.getpid()))
    engine = SGLangRolloutEngine("/model", moe_layers=([True, False, True], 4))
    assert engine._engine.server_args["enable_return_routed_experts"] is True
    params = SamplingParams(temperature=1.0, max_new_tokens=10_000, return_routed_experts=True)
    engine.stream_wait_s = 0.02
    group = StreamGroup(3, [1, 2, 3], [StreamRow(11)])
    engine.stream_add([group], params)
    engine.stream_step(64, version=1)
    (cut,) = engine.stream_abort(version=1)
    row = cut.rows[0]
    held = len(row.token_ids)
    assert held > 0 and np.array_equal(row.routed_experts, routed(range(3 + held - 1), 0))
    engine.stream_add([cut], params)
    engine.stream_step(64, version=2)
    (cut,) = engine.stream_abort(version=2)
    assert len(row.token_ids) > held and len(row.routed_experts) == 3 + len(row.token_ids) - 1
    assert np.array_equal(row.routed_experts[: 3 + held - 1], routed(range(3 + held - 1), 0))
    assert np.array_equal(row.routed_experts[3 + held - 1 :], routed(range(3 + held - 1, len(row.routed_experts)), 1))
    engine._engine.finish = {"type": "stop", "matched": 1}
    (generation,) = engine.generate([[4, 5]], params)
    assert np.array_equal(generation.routed_experts, routed(range(3), engine._engine.answers - 1))
    without = SGLangRolloutEngine("/model")
    assert "enable_return_routed_experts" in without._engine.server_args
    with pytest.raises(ValueError, match="without moe_layers"):
        without.generate([[4, 5]], params)
