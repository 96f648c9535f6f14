"""The CPU runtime switches on only when asked, redirects CUDA calls, and undoes itself."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.config import ParallelConfig
from dapo_megatron.runtime import cpu_compat
from dapo_megatron.runtime.distributed import LaunchError, megatron_runtime, resolve_device


@pytest.fixture(autouse=True)
def _cpu_runtime_off():
    cpu_compat.disable_cpu_runtime()
    yield
    cpu_compat.disable_cpu_runtime()


def test_redirects_cuda_calls_and_restores_them():
    original_current_device = torch.cuda.current_device
    cpu_compat.enable_cpu_runtime()
    try:
        assert cpu_compat.cpu_runtime_enabled()
        x = torch.zeros(3, device="cuda")
        y = torch.ones(2, device=torch.cuda.current_device())
        z = torch.empty(1, device=torch.device("cuda", 0))
        assert x.device.type == y.device.type == z.device.type == "cpu"
        assert x.cuda() is x and x.to("cuda").device.type == "cpu"
        assert x.to(torch.float64).dtype == torch.float64  # dtype conversions still happen
        assert x.type() == "torch.cuda.FloatTensor"
        # The "CUDA" RNG is the CPU generator: seeding it reproduces CPU draws.
        torch.cuda.manual_seed(5)
        a = torch.rand(4)
        state = torch.cuda.get_rng_state()
        b = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(4), b) and not torch.equal(a, b)
    finally:
        cpu_compat.disable_cpu_runtime()
    assert not cpu_compat.cpu_runtime_enabled()
    assert torch.cuda.current_device is original_current_device
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_refuses_to_enable_on_a_gpu_machine_unless_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        cpu_compat.enable_cpu_runtime()
    assert not cpu_compat.cpu_runtime_enabled()
    assert resolve_device("auto") == "cuda"


def test_auto_resolves_to_cpu_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("machine has a GPU")
    assert resolve_device("auto") == "cpu"
    with pytest.raises(LaunchError, match="no GPU is visible"):
        resolve_device("cuda")


def test_single_rank_runtime_up_and_down(monkeypatch):
    from megatron.core import parallel_state

    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with megatron_runtime(ParallelConfig(device="cpu"), seed=3) as info:
        assert info.backend == "gloo" and info.world_size == 1 and info.is_cpu
        assert parallel_state.model_parallel_is_initialized()
        assert torch.distributed.get_backend() == "gloo"
    assert not torch.distributed.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()
    assert not cpu_compat.cpu_runtime_enabled()


def test_launched_world_size_must_match_layout(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(LaunchError, match="launched 1 processes but the layout needs"):
        with megatron_runtime(ParallelConfig(device="cpu", tp_size=2, num_devices_per_node=2), seed=0):
            pass


def test_local_rank_comes_from_the_launcher_or_is_refused_across_gpu_nodes():
    from dapo_megatron.runtime.distributed import local_rank_of

    two_nodes = ParallelConfig(num_nodes=2, num_devices_per_node=4)
    one_node = ParallelConfig(num_nodes=1, num_devices_per_node=4)
    assert local_rank_of({"RANK": "6", "LOCAL_RANK": "2"}, two_nodes, "cuda") == 2
    assert local_rank_of({"RANK": "3"}, one_node, "cuda") == 3
    assert local_rank_of({"RANK": "6"}, two_nodes, "cpu") == 6
    with pytest.raises(LaunchError, match="LOCAL_RANK is not set on a 2-node GPU launch \\(global rank 6\\)"):
        local_rank_of({"RANK": "6"}, two_nodes, "cuda")


UNCOMPILED_RANK = """
import sys, torch
from dapo_megatron.config import ParallelConfig
from dapo_megatron.runtime.distributed import megatron_runtime
compile_function = torch.compile
with megatron_runtime(ParallelConfig(device="cpu"), seed=1):
    from megatron.core.jit import jit_fuser
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router import TopKRouter
    function = lambda x: x
    print(jit_fuser(function) is function, "torch._dynamo" in sys.modules, torch.compile is compile_function)
"""


def test_a_cpu_rank_imports_megatron_without_torchs_compiler():
    """A CPU rank's megatron: its jit_fuser functions plain Python (megatron's import would
    otherwise import dynamo and inductor, ~1.2 s of each rank's start), torch.compile
    itself untouched afterwards. In a fresh interpreter: this one has megatron already."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", UNCOMPILED_RANK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False", "True"], done.stdout
