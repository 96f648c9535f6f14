"""The SGLang wrapper against the supported SGLang release's source, without importing SGLang.

SGLang's CUDA kernels do not install on these machines, so the wheel (downloaded by
``make test``) is read as a zip and parsed with ``ast``: every class, method, keyword
argument, server argument and sampling key the wrapper uses must exist there by name;
and beyond names, what the calls answer and what state they need: which answer
``(success, message)`` (the wrapper checks each), which answer nothing, that weight
updates load only inside a begin/end session, that a release keeps no weights without a
CPU backup, that per-request seeds are honoured only with deterministic inference, which
finish reasons and stop tokens SGLang produces. ``test_sglang_wrapper.py`` runs the
wrapper against a stand-in that follows these rules.
"""

from __future__ import annotations

import ast
import os
import zipfile
from functools import lru_cache
from pathlib import Path

import pytest

from dapo_megatron.rollout import sglang_engine
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.rollout.sglang_engine import (
    SGLANG_API,
    SGLANG_CHECKED_CALLS,
    SGLANG_SAMPLING_KEYS,
    SGLANG_SERVER_ARGS,
    SUPPORTED_SGLANG,
    finish_reason_of,
    row_sampling_params,
)

ROOT = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=1)
def wheel() -> zipfile.ZipFile:
    explicit = os.environ.get("SGLANG_WHEEL")
    candidates = [Path(explicit)] if explicit else sorted((ROOT / ".venv" / "sglang-wheel").glob("sglang-*.whl"))
    assert candidates, "no SGLang wheel: `make test` downloads it into .venv/sglang-wheel (or set SGLANG_WHEEL)"
    assert f"sglang-{SUPPORTED_SGLANG}-" in candidates[-1].name, (
        f"{candidates[-1].name} is not sglang {SUPPORTED_SGLANG}"
    )
    return zipfile.ZipFile(candidates[-1])


def parse(path: str) -> ast.Module:
    return ast.parse(wheel().read(path).decode())


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def parameters(function: ast.FunctionDef) -> tuple[set[str], bool]:
    args = function.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    return names, args.kwarg is not None


def test_engine_methods_and_keyword_arguments_exist():
    for target, methods in SGLANG_API.items():
        module, qualname = target.split(":")
        cls = find_class(parse(module.replace(".", "/") + ".py"), qualname)
        defined = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for method, keywords in methods.items():
            assert method in defined, f"{qualname}.{method} does not exist in sglang {SUPPORTED_SGLANG}"
            names, _ = parameters(defined[method])
            missing = set(keywords) - names
            assert not missing, f"{qualname}.{method} has no keyword(s) {sorted(missing)}"


def test_engine_is_exported_and_takes_server_args():
    init = parse("sglang/__init__.py")
    assert "Engine" in ast.unparse(init)
    engine_init = next(
        n
        for n in find_class(parse("sglang/srt/entrypoints/engine.py"), "Engine").body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    assert parameters(engine_init)[1], "Engine.__init__ no longer takes **kwargs (server args)"
    fields = set()
    for name in wheel().namelist():
        if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
            for node in ast.walk(parse(name)):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    fields.add(node.target.id)
    missing = set(SGLANG_SERVER_ARGS) - fields
    assert not missing, f"server args not in sglang {SUPPORTED_SGLANG}: {sorted(missing)}"


def test_the_trainers_engines_can_start_without_reading_weights():
    """``load_format="dummy"`` (the trainer's engines: the actor's sync fills the weights)
    is one of the release's load formats."""
    tree = parse("sglang/srt/arg_groups/choices.py")
    choices = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LOAD_FORMAT_CHOICES" for t in node.targets)
    )
    assert "dummy" in ast.literal_eval(choices) and "auto" in ast.literal_eval(choices)


def test_sampling_params_keys_exist():
    cls = find_class(parse("sglang/srt/sampling/sampling_params.py"), "SamplingParams")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    missing = set(SGLANG_SAMPLING_KEYS) - fields
    assert not missing, f"sampling params not in sglang {SUPPORTED_SGLANG}: {sorted(missing)}"


def test_output_fields_read_by_the_wrapper_exist():
    source = wheel().read("sglang/srt/managers/tokenizer_manager.py").decode()
    for key in ("output_token_logprobs", "finish_reason", "output_ids", "meta_info"):
        assert f'"{key}"' in source, f"{key} not produced by sglang {SUPPORTED_SGLANG}'s tokenizer manager"


def test_wrapper_uses_nothing_outside_the_declared_api():
    tree = ast.parse(Path(sglang_engine.__file__).read_text())
    declared = SGLANG_API["sglang.srt.entrypoints.engine:Engine"]
    engine_calls, constructor_keywords, sampling_keys = [], set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "_engine":
                engine_calls.append((node.func.attr, {k.arg for k in node.keywords}))
            if isinstance(owner, ast.Name) and owner.id == "sglang" and node.func.attr == "Engine":
                constructor_keywords |= {k.arg for k in node.keywords}
        if isinstance(node, ast.FunctionDef) and node.name == "row_sampling_params":
            for inner in ast.walk(node):
                if isinstance(inner, ast.Dict):
                    sampling_keys |= {k.value for k in inner.keys if isinstance(k, ast.Constant)}
    assert len(engine_calls) >= 8 and constructor_keywords and sampling_keys
    for method, keywords in engine_calls:
        assert method in declared, f"wrapper calls Engine.{method}, not declared in SGLANG_API"
        assert keywords <= set(declared[method]), (
            f"Engine.{method}: undeclared keywords {keywords - set(declared[method])}"
        )
    assert constructor_keywords <= set(SGLANG_SERVER_ARGS)
    assert sampling_keys <= set(SGLANG_SAMPLING_KEYS)


def test_module_imports_without_sglang_and_says_what_to_do(monkeypatch):
    monkeypatch.setenv(sglang_engine.ENGINE_PROCESS_ENV, str(os.getpid()))
    try:
        import sglang  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'dapo-megatron\[gpu\]'.*rollout.engine=hf"):
            sglang_engine.SGLangRolloutEngine("/nonexistent")
    else:
        pytest.skip("sglang is installed here")


def test_broadcast_protocol_matches_sglangs_receiver():
    """broadcast_sync sends dtype names SGLang resolves with getattr(torch, name), one
    broadcast per tensor from group rank 0, in the announced order; and builds its group
    the way SGLang builds its end (group ranks as global ranks)."""
    receiver = wheel().read("sglang/srt/model_executor/model_runner_components/weight_updater.py").decode()
    assert "getattr(torch, dtype)" in receiver
    assert "for name, dtype, shape in zip(names, dtypes, shapes)" in receiver
    assert "src=0" in receiver
    group_helper = wheel().read("sglang/srt/utils/common.py").decode()
    assert "_world.pg_group_ranks[pg] = {i: i for i in range(world_size)}" in group_helper
    assert "PrefixStore(group_name, store)" in group_helper
    import torch

    from dapo_megatron.weight_sync.broadcast import bucket_metadata
    from dapo_megatron.weight_sync.bucket import WeightBucket

    names, dtypes, shapes = bucket_metadata(WeightBucket([("a", torch.zeros(2, 3, dtype=torch.bfloat16))]))
    assert (names, dtypes, shapes) == (["a"], ["bfloat16"], [[2, 3]]) and getattr(torch, dtypes[0]) is torch.bfloat16


def _functions(path: str) -> dict[str, ast.AST]:
    return {n.name: n for n in ast.walk(parse(path)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


TOKENIZER_CONTROL = "sglang/srt/managers/tokenizer_control_mixin.py"
WEIGHT_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"


def test_checked_calls_answer_success_and_message_and_the_rest_answer_nothing():
    """Engine.<call> returns the tokenizer manager's answer: (success, message) for the
    weight calls, nothing for release/resume (so there is nothing to check there)."""
    engine = _functions("sglang/srt/entrypoints/engine.py")
    control = _functions(TOKENIZER_CONTROL)
    for call in SGLANG_CHECKED_CALLS:
        assert ast.unparse(control[call].returns) == "Tuple[bool, str]", call
        returned = [ast.unparse(r.value) for r in ast.walk(engine[call]) if isinstance(r, ast.Return) and r.value]
        assert any(f"self.tokenizer_manager.{call}(" in r for r in returned), (call, returned)
    for call in ("release_memory_occupation", "resume_memory_occupation"):
        assert control[call].returns is None
        assert not [r for r in ast.walk(control[call]) if isinstance(r, ast.Return) and r.value is not None], call
    unchecked = set(SGLANG_API["sglang.srt.entrypoints.engine:Engine"]) - set(SGLANG_CHECKED_CALLS)
    assert unchecked == {
        "release_memory_occupation",
        "resume_memory_occupation",
        "get_server_info",
        "shutdown",
        "async_generate",
    }


SCHEDULER = "sglang/srt/managers/scheduler.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"


def test_the_engine_holds_the_loop_and_tokenizer_manager_streaming_uses():
    from dapo_megatron.rollout.sglang_engine import SGLANG_ENGINE_ATTRIBUTES

    init = _functions("sglang/srt/entrypoints/engine.py")["__init__"]
    assigned = {
        target.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self"
    }
    assert set(SGLANG_ENGINE_ATTRIBUTES) <= assigned
    # async_generate without stream answers the request's one output (not an iterator).
    body = ast.unparse(_functions("sglang/srt/entrypoints/engine.py")["async_generate"])
    assert "return await generator.__anext__()" in body


def test_an_abort_matches_ids_by_prefix_and_returns_a_running_requests_tokens():
    """What streamed generation's abort relies on: the scheduler matches request ids by
    prefix (so the wrapper's ids have one width), a running request is finished with a
    plain FINISH_ABORT() (no status code), and the tokenizer manager raises only for an
    abort with an HTTP status code, so ours come back as outputs with their tokens."""
    from dapo_megatron.rollout.sglang_engine import stream_request_id

    abort = ast.unparse(_functions(SCHEDULER)["abort_request"])
    assert "req.rid.startswith(recv_req.rid)" in abort
    assert "req.to_finish = FINISH_ABORT()" in abort
    handle = ast.unparse(_functions(TOKENIZER_MANAGER)["_handle_abort_finish_reason"])
    assert "status_code is None" in handle and "return None" in handle
    ids = [stream_request_id(key, row, length) for key in (1, 17, 2**40) for row in (0, 9, 10) for length in (0, 5, 50)]
    assert len({len(i) for i in ids}) == 1 and len(set(ids)) == len(ids)
    assert not [a for a in ids for b in ids if a != b and b.startswith(a)]


def test_wrapper_checks_every_answer():
    """Each call of a (success, message) method is checked with its own name, except the
    best-effort close inside abort_weight_update (already failing)."""
    tree = ast.parse(Path(sglang_engine.__file__).read_text())
    checked_args = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "checked":
            name, answer = node.args
            assert isinstance(answer, ast.Call) and answer.func.attr == name.value, ast.unparse(node)
            checked_args.add(id(answer))
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    seen = set()
    for function in functions:
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "_engine"
                and node.func.attr in SGLANG_CHECKED_CALLS
            ):
                seen.add(node.func.attr)
                assert id(node) in checked_args or function.name == "abort_weight_update", (
                    f"{function.name}: the answer of Engine.{node.func.attr} is not checked"
                )
    assert seen == set(SGLANG_CHECKED_CALLS)


def test_weight_updates_load_only_inside_a_session():
    """The scheduler answers (False, ...) to an update outside begin/end, and refuses to
    open a second session or close none: the rules the stand-in follows."""
    updater = _functions(WEIGHT_UPDATER)
    for call in ("update_weights_from_tensor", "update_weights_from_distributed"):
        text = ast.unparse(updater[call])
        assert "if self._session is None" in text and "success=False" in text, call
        assert "must run between begin_weight_update() and end_weight_update()" in text.replace("' '", ""), call
    assert "a weight-update session is already open" in ast.unparse(updater["begin_weight_update"])
    assert "no weight-update session is open" in ast.unparse(updater["end_weight_update"])


def test_release_discards_weights_without_a_cpu_backup():
    """Releasing the weights pauses their memory; only enable_weights_cpu_backup (off by
    default, not passed by the wrapper) keeps a copy: the wrapper asks for a full update
    afterwards (its behaviour: test_sglang_wrapper.py)."""
    release = ast.unparse(_functions(WEIGHT_UPDATER)["release_memory_occupation"])
    assert "self.memory_saver_adapter.pause(GPU_MEMORY_TYPE_WEIGHTS)" in release
    exec_fields = parse("sglang/srt/arg_groups/fields/exec_.py")
    backup = next(
        n
        for n in ast.walk(exec_fields)
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "enable_weights_cpu_backup"
    )
    assert ast.literal_eval(backup.value) is False
    assert "enable_weights_cpu_backup" not in SGLANG_SERVER_ARGS


def test_sampling_seed_only_with_deterministic_inference():
    info = wheel().read("sglang/srt/sampling/sampling_batch_info.py").decode()
    seed_block = info[info.index("sampling_seed = (") : info.index("sampling_seed = (") + 600]
    assert "if enable_deterministic" in seed_block and "else 42" in seed_block
    assert "enable_deterministic_inference" in SGLANG_SERVER_ARGS


def test_finish_reasons_and_stop_tokens():
    """SGLang reports abort as its own type, and stops on the request's stop_token_ids
    and on the model's EOS ids (the transformers engine stops on the same union)."""
    path = "sglang/srt/managers/schedule_batch.py"
    abort = find_class(parse(path), "FINISH_ABORT")
    to_json = next(n for n in abort.body if isinstance(n, ast.FunctionDef) and n.name == "to_json")
    assert "'type': 'abort'" in ast.unparse(to_json)
    finish = ast.unparse(_functions(path)["_check_token_based_finish"])
    assert "self.sampling_params.stop_token_ids" in finish and "self.eos_token_ids" in finish


def test_a_matched_stop_string_ends_the_ids_with_the_token_that_completes_it():
    """Multi-turn turns end on an environment's text (``stop``): SGLang sends the output
    ids through the token that completes the string, the stop included, and a log-prob for
    each of them; its finish reason is a ``stop`` that names the string (the wrapper's
    ``finish_reason_of`` reads it as ``stop``)."""
    batch = "sglang/srt/managers/schedule_batch.py"
    functions = _functions(batch)
    locate = functions["_locate_str_stop_finished_len"]
    assert "stop included" in ast.get_docstring(locate)
    assert "self.finished_reason = FINISH_MATCHED_STR(matched=stop_str)" in ast.unparse(
        functions["_check_str_based_finish"]
    )
    through = ast.unparse(functions["output_ids_through_stop"])
    assert "self.output_ids[:self.finished_len]" in through
    streamer = wheel().read("sglang/srt/managers/scheduler_components/output_streamer.py").decode()
    assert "output_ids_ = req.output_ids_through_stop" in streamer
    assert "len(output_ids_) if req.is_retracted else max(len(output_ids_), 1)" in streamer  # logprob_end
    matched = find_class(parse(batch), "FINISH_MATCHED_STR")
    to_json = ast.unparse(next(n for n in matched.body if isinstance(n, ast.FunctionDef) and n.name == "to_json"))
    assert "'type': 'stop'" in to_json and "'matched': self.matched" in to_json
    assert finish_reason_of({"finish_reason": {"type": "stop", "matched": "</calc>"}}) == "stop"
    rows = row_sampling_params(SamplingParams(stop_strings=("</calc>",), row_seeds=(5,)), 1)
    assert rows == [{**rows[0], "stop": ["</calc>"], "sampling_seed": 5}]


def test_engine_changes_process_wide_settings():
    """Why engines are built only in their own processes."""
    source = wheel().read("sglang/srt/entrypoints/engine.py").decode()
    assert 'os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"' in source
    device_fields = parse("sglang/srt/arg_groups/fields/device.py")
    base = next(
        n
        for n in ast.walk(device_fields)
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "base_gpu_id"
    )
    assert ast.literal_eval(base.value) == 0  # every engine would take GPU 0 onwards unless told


def test_gpu_extra_pins_what_the_wrapper_and_megatron_were_checked_against():
    """setup.py's gpu extra: sglang at the supported release, the torch that release
    pins, the megatron-core this suite tests, and Transformer Engine in the range
    megatron-core's own dev extra tests."""
    import importlib.metadata
    import re

    from packaging.requirements import Requirement

    gpu = next(
        ast.literal_eval(value)
        for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
        if isinstance(node, ast.Dict)
        for key, value in zip(node.keys, node.values)
        if isinstance(key, ast.Constant) and key.value == "gpu"
    )
    metadata = wheel().read(f"sglang-{SUPPORTED_SGLANG}.dist-info/METADATA").decode()
    sglang_torch = re.search(r"^Requires-Dist: (torch==[\d.]+)$", metadata, re.M).group(1)
    megatron_te = next(
        r.split(";")[0].strip()
        for r in importlib.metadata.requires("megatron-core")
        if r.startswith("transformer-engine") and 'extra == "dev"' in r
    )
    assert f"sglang=={SUPPORTED_SGLANG}" in gpu and sglang_torch in gpu
    # The megatron-core the CPU suite runs, on the GPU too (Python 3.12 would take a newer one).
    assert f"megatron-core=={importlib.metadata.version('megatron-core')}" in gpu
    te = Requirement(next(g for g in gpu if g.startswith("transformer-engine")))
    assert te.specifier == Requirement(megatron_te).specifier and "pytorch" in te.extras, (te, megatron_te)


def test_tp_workers_load_their_own_flattened_bucket_payload():
    """What a colocated update sends: ``load_format="flattened_bucket"`` with one payload
    per TP rank, each the whole bucket (its flat tensor and a FlattenedTensorMetadata per
    tensor, built by ``flat_bucket`` with exactly that class's fields). The Engine passes
    such payloads through as they are, each worker deserializes its own (index tp_rank),
    reads every tensor from its byte range and loads it, and SGLang's safe unpickler lets
    the metadata class through."""
    import torch

    from dapo_megatron.weight_sync.bucket import flat_bucket

    engine = ast.unparse(_functions("sglang/srt/entrypoints/engine.py")["_serialize_tensors_per_rank"])
    assert "if load_format == 'flattened_bucket':" in engine
    assert "return normalize_serialized_named_tensor_payloads(" in engine
    worker = ast.unparse(_functions("sglang/srt/managers/tp_worker.py")["deserialize_own_rank"])
    assert "serialized_named_tensors[get_parallel().tp_rank]" in worker
    updater = _functions("sglang/srt/model_executor/model_runner_components/weight_updater.py")
    update = ast.unparse(updater["update_weights_from_tensor"])
    assert "if load_format == 'flattened_bucket':" in update
    assert "flattened_tensor_bucket_dict=named_tensors" in update
    flat = ast.unparse(updater["_update_weights_from_flattened_bucket"])
    assert "flattened_tensor_bucket_dict['flattened_tensor']" in flat
    assert "flattened_tensor_bucket_dict['metadata']" in flat and "self.get_model().load_weights(" in flat
    tensor_bucket = parse("sglang/srt/weight_sync/tensor_bucket.py")
    metadata = find_class(tensor_bucket, "FlattenedTensorMetadata")
    fields = [n.target.id for n in metadata.body if isinstance(n, ast.AnnAssign)]
    assert fields == ["name", "shape", "dtype", "start_idx", "end_idx", "numel"]
    assert all(f"meta.{field}" in flat for field in fields)
    reconstruct = ast.unparse(find_class(tensor_bucket, "FlattenedTensorBucket"))
    assert "self.flattened_tensor[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)" in reconstruct
    sent = flat_bucket(torch.zeros(64, dtype=torch.uint8), [("w", (2, 3), torch.float32, 0, 0)], dict)
    assert list(sent) == ["flattened_tensor", "metadata"] and list(sent["metadata"][0]) == fields
    unpickler = wheel().read("sglang/srt/utils/common.py").decode()
    assert '("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")' in unpickler
    assert '("builtins", "dict")' in unpickler
    patch = wheel().read("sglang/srt/utils/patch_torch.py").decode()
    assert "def monkey_patch_torch_reductions" in patch and "uuid" in patch.lower()


# ------------------------------------------------------------------ model families' weight names


def _load_weights(model_file: str, model_class: str) -> ast.FunctionDef:
    cls = find_class(parse(model_file), model_class)
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")


def _stacked_params_mapping(function: ast.FunctionDef) -> list[tuple]:
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "stacked_params_mapping" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("no stacked_params_mapping")


def _sglang_expert_mapping(function: ast.FunctionDef, num_experts: int) -> list[tuple]:
    """SGLang's own ``FusedMoE.make_expert_params_mapping``, run from the wheel's source
    with the checkpoint names the model's ``load_weights`` passes it."""
    call = next(
        n
        for n in ast.walk(function)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "make_expert_params_mapping"
    )
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "num_experts"}
    fused_moe = find_class(parse("sglang/srt/layers/moe/fused_moe_triton/layer.py"), "FusedMoE")
    method = next(
        n for n in fused_moe.body if isinstance(n, ast.FunctionDef) and n.name == "make_expert_params_mapping"
    )
    method.decorator_list = []
    namespace: dict = {"List": list, "Tuple": tuple}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "make_expert_params_mapping", "exec"), namespace)
    return namespace["make_expert_params_mapping"](None, num_experts=num_experts, **kwargs)


def _attributes(*model_files: str) -> set[str]:
    """Every ``self.<name> = ...`` of the model files' classes: the module names their
    parameters can have."""
    names = set()
    for path in model_files:
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(element, ast.Attribute) and getattr(element.value, "id", None) == "self":
                            names.add(element.attr)
    return names


def _route(name: str, stacked: list[tuple], experts: list[tuple]) -> str:
    """The parameter SGLang's ``load_weights`` (Qwen3 / Qwen3-MoE) loads checkpoint tensor
    ``name`` into, following its loop: stacked q/k/v and gate/up (experts skipped there),
    then the experts' mapping, then the name itself."""
    for param_name, weight_name, _ in stacked:
        if weight_name in name and "mlp.experts" not in name:
            return name.replace(weight_name, param_name)
    for param_name, weight_name, _, _ in experts:
        if weight_name in name:
            return name.replace(weight_name, param_name)
    return name


@pytest.mark.parametrize(
    ("family", "model_file", "model_class"),
    [
        ("qwen3", "sglang/srt/models/qwen3.py", "Qwen3ForCausalLM"),
        ("qwen3_moe", "sglang/srt/models/qwen3_moe.py", "Qwen3MoeForCausalLM"),
    ],
)
def test_sglang_loads_every_name_the_weight_sync_sends(family, model_file, model_class):
    """Each HF name the weight sync sends for Qwen3 (q/k norms) and Qwen3-MoE (the router
    ``mlp.gate``, each expert's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``) reaches a
    parameter of SGLang's model by the 0.5.23 wheel's ``load_weights``: the stacked q/k/v
    and gate/up, and SGLang's own expert mapping (gate and up into ``w13_weight`` as shards
    w1 and w3, down into ``w2_weight``) for every expert."""
    from dapo_megatron.ckpt.mapping import ModelShape, hf_shapes

    shape = ModelShape(2, 64, 96, 8, 2, 250, False, head_dim=16, qkv_bias=False, qk_norm=True)
    if family == "qwen3_moe":
        shape = ModelShape(**{**shape.__dict__, "num_experts": 4, "moe_ffn_hidden_size": 24, "moe_router_topk": 2})
    function = _load_weights(model_file, model_class)
    stacked = _stacked_params_mapping(function)
    assert {(p, w, s) for p, w, s in stacked} >= {
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    }
    experts = _sglang_expert_mapping(function, shape.num_experts) if family == "qwen3_moe" else []
    attributes = _attributes(model_file, "sglang/srt/models/qwen2.py")
    fused_params = set()
    for node in ast.walk(parse("sglang/srt/layers/quantization/unquant.py")):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "register_parameter":
            fused_params.add(ast.literal_eval(node.args[0]))
    sent = sorted(hf_shapes(shape))
    targets = {name: _route(name, stacked, experts) for name in sent}
    for name, target in targets.items():
        *modules, leaf = target.split(".")
        modules = [m for m in modules if not m.isdigit() and m != "model"]
        if ".mlp.experts." in name:
            assert modules[-1] == "experts" and leaf in fused_params, (name, target)
            modules = modules[:-1]
        else:
            assert leaf == "weight", (name, target)
        missing = [m for m in modules if m not in attributes]
        assert not missing, (name, target, missing)
    if family == "qwen3_moe":
        routed = {t for n, t in targets.items() if ".mlp.experts." in n}
        assert routed == {f"model.layers.{i}.mlp.experts.w{k}_weight" for i in range(2) for k in (13, 2)}
        shards = {(e, s) for _, w, e, s in experts if f"experts.{e}.gate_proj." == w or f"experts.{e}.up_proj." == w}
        assert shards == {(e, s) for e in range(4) for s in ("w1", "w3")}
        assert {"gate", "experts", "q_norm", "k_norm"} <= attributes


# ------------------------------------------------------------------ what the wrapper's edge cases rely on


def test_a_request_refused_with_an_http_status_raises_and_fails_a_whole_batch():
    """Why every row is a request of its own and a refusal is caught per row
    (:func:`request_refusal`): an abort carrying an HTTP status raises ValueError for 400
    and fastapi's HTTPException (status_code, detail) otherwise; a request that timed
    out is aborted with 503; an input longer than the context raises ValueError on
    arrival; the batch call gathers its rows without return_exceptions (one refusal fails
    every row); and an abort for a request id with no state is dropped (the abort's wait
    needs a bound)."""
    from dapo_megatron.rollout.sglang_engine import request_refusal

    functions = _functions(TOKENIZER_MANAGER)
    handle = ast.unparse(functions["_handle_abort_finish_reason"])
    bad_request = handle[handle.index("if status_code == HTTPStatus.BAD_REQUEST:") :]
    assert bad_request.split(":", 1)[1].split("\n")[1].strip() == "raise ValueError(finish_reason['message'])"
    assert "raise fastapi.HTTPException(status_code=status_code, detail=finish_reason['message'])" in handle
    assert "not HTTPStatus.BAD_REQUEST <= status_code < 600" in handle
    validate = ast.unparse(functions["_validate_one_request"])
    assert "exceeds the model's maximum context length" in validate and "raise ValueError(error_msg)" in validate
    batch = ast.unparse(functions["_collect_batch_responses"])
    assert "return await asyncio.gather(*tasks)" in batch
    manager = find_class(parse(TOKENIZER_MANAGER), "TokenizerManager")
    abort = ast.unparse(next(n for n in manager.body if getattr(n, "name", "") == "abort_request"))
    no_state = abort[abort.index("elif get_serving().tokenizer_worker_num == 1:") :]
    assert no_state.split("\n")[1].strip() == "return"
    scheduler = ast.unparse(_functions(SCHEDULER)["abort_request"])
    assert "FINISH_ABORT(recv_req.abort_message, HTTPStatus.SERVICE_UNAVAILABLE)" in scheduler
    # What request_refusal makes of them; anything else is the engine's failure.
    from tests.unit.test_sglang_wrapper import HTTPException

    assert request_refusal(HTTPException(503, "timed out")) == "HTTP 503: timed out"
    assert request_refusal(ValueError("too long")) == "HTTP 400: too long"
    assert request_refusal(RuntimeError("scheduler died")) is None
    assert request_refusal(HTTPException(200, "ok")) is None


def test_the_engine_takes_the_actors_dtypes_by_name():
    """``dtype`` is a server arg whose choices include the actor's two parameter dtypes,
    by torch's names (the trainer passes ``str(dtype)`` without ``torch.``)."""
    fields = parse("sglang/srt/arg_groups/fields/model.py")
    dtype = next(n for n in ast.walk(fields) if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "dtype")
    choices = next(
        ast.literal_eval(k.value)
        for n in ast.walk(dtype)
        if isinstance(n, ast.Call)
        for k in n.keywords
        if k.arg == "choices"
    )
    assert {"float32", "bfloat16"} <= set(choices) and ast.literal_eval(dtype.value) == "auto"
    assert "dtype" in SGLANG_SERVER_ARGS


def test_sglangs_qwen_models_cannot_hand_their_weights_back():
    """Why ``served_weights`` refuses an SGLang engine: the model runner's
    get_weights_by_name delegates to the model's, which Qwen2, Qwen3 and Qwen3-MoE lack."""
    exporter = ast.unparse(
        _functions("sglang/srt/model_executor/model_runner_components/weight_exporter.py")["get_weights_by_name"]
    )
    assert "self.get_model().get_weights_by_name(" in exporter
    for path, name in [
        ("sglang/srt/models/qwen2.py", "Qwen2ForCausalLM"),
        ("sglang/srt/models/qwen3.py", "Qwen3ForCausalLM"),
        ("sglang/srt/models/qwen3_moe.py", "Qwen3MoeForCausalLM"),
    ]:
        cls = find_class(parse(path), name)
        assert "get_weights_by_name" not in {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}, name


def test_routed_experts_come_as_base64_int32_of_every_position_but_the_last():
    """What :func:`sglang_engine.routed_experts_of_meta` decodes, as the wheel writes it:
    the capture's buffers are int32, the detokenizer sends each request's tensor as
    base64 of its raw bytes, SGLang's own reader takes int32 back, and the record covers
    ``[routed_experts_start_len, seqlen - 1)`` (the wrapper asks from 0)."""
    capturer = wheel().read("sglang/srt/state_capturer/routed_experts.py").decode()
    assert "dtype=torch.int32" in capturer and "dtype=np.int32" in capturer
    detokenizer = wheel().read("sglang/srt/managers/detokenizer_manager.py").decode()
    assert "b64encode(item.numpy().tobytes())" in detokenizer
    request = find_class(parse("sglang/srt/managers/io_struct.py"), "GenerateReqInput")
    fields = {node.target.id: node for node in request.body if isinstance(node, ast.AnnAssign)}
    assert ast.literal_eval(fields["routed_experts_start_len"].value) == 0
    assert "`[routed_experts_start_len, seqlen - 1)`" in wheel().read("sglang/srt/managers/io_struct.py").decode()
