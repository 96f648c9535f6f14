"""The SGLang wrapper against the supported SGLang release's source, without importing SGLang.

SGLang's CUDA kernels do not install on these machines, so the wheel (downloaded by
``make test``) is read as a zip and parsed with ``ast``: every class, method, keyword
argument, server argument and sampling key the wrapper uses must exist there by name.
"""

from __future__ import annotations

import ast
import os
import zipfile
from functools import lru_cache
from pathlib import Path

import pytest

from dapo_megatron.rollout import sglang_engine
from dapo_megatron.rollout.sglang_engine import (
    SGLANG_API,
    SGLANG_SAMPLING_KEYS,
    SGLANG_SERVER_ARGS,
    SUPPORTED_SGLANG,
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
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "sampling" for t in node.targets):
            sampling_keys |= {k.value for k in node.value.keys}
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "sampling":
            sampling_keys.add(node.slice.value)
    assert len(engine_calls) >= 8 and constructor_keywords and sampling_keys
    for method, keywords in engine_calls:
        assert method in declared, f"wrapper calls Engine.{method}, not declared in SGLANG_API"
        assert keywords <= set(declared[method]), (
            f"Engine.{method}: undeclared keywords {keywords - set(declared[method])}"
        )
    assert constructor_keywords <= set(SGLANG_SERVER_ARGS)
    assert sampling_keys <= set(SGLANG_SAMPLING_KEYS)


def test_module_imports_without_sglang_and_says_what_to_do():
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

    from dapo_megatron.actor.broadcast_sync import bucket_metadata
    from dapo_megatron.rollout.engine import WeightBucket

    names, dtypes, shapes = bucket_metadata(WeightBucket([("a", torch.zeros(2, 3, dtype=torch.bfloat16))]))
    assert (names, dtypes, shapes) == (["a"], ["bfloat16"], [[2, 3]]) and getattr(torch, dtypes[0]) is torch.bfloat16
