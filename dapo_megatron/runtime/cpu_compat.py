"""Let megatron-core's own CUDA-assuming code run on a CPU, with gloo.

megatron-core is written for GPUs: it creates tensors with ``device="cuda"`` or
``device=torch.cuda.current_device()``, keeps "CUDA" RNG states for its tensor-parallel
tracker, asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` and synchronises
streams. None of that is a statement about the maths, so on a machine without a GPU we
redirect it: a :class:`torch.overrides.TorchFunctionMode` turns every CUDA device
argument into the CPU (and ``Tensor.cuda()`` into a no-op), and a handful of
``torch.cuda`` functions plus megatron's RNG helpers are replaced by their CPU
equivalents. The real GPTModel, pipeline schedules, DDP, distributed optimizer and dist
checkpointing then run unchanged.

This is switched on only by :func:`enable_cpu_runtime`, which the runtime calls when the
run asks for ``device: cpu`` (or ``auto`` on a machine without a GPU). It refuses to
switch on when CUDA is available and the run did not ask for the CPU, and it never
touches a GPU run. :func:`disable_cpu_runtime` restores every patched attribute.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    """True for anything megatron uses to name a CUDA device: "cuda", "cuda:1", an int."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # An int device ordinal is how torch.cuda.current_device() results are passed around.
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_if_cuda(device: Any) -> Any:
    return _CPU if _is_cuda_device(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrite CUDA device arguments to the CPU for every torch call made under it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device:
            if args and _is_cuda_device(args[0]):
                return _CPU
            return func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts e.g. `grad.type() == 'torch.cuda.FloatTensor'`; on the CPU
            # runtime the CPU is the device, so answer with the CUDA spelling.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func in (torch.Tensor.to, torch.Tensor.pin_memory):
            if func is torch.Tensor.pin_memory:
                return args[0]
            args = (args[0],) + tuple(_cpu_if_cuda(a) if isinstance(a, (str, torch.device)) else a for a in args[1:])
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return func(*args, **kwargs)


class _Patches:
    """Attribute patches that can all be undone, in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        # A class's own attribute as stored (a staticmethod stays one when restored).
        saved = owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)
        self._saved.append((owner, name, saved))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


class _NullEvent:
    """Stands in for torch.cuda.Event: CPU work is done when the call returns (megatron's
    all-to-all token dispatcher records one and synchronises on it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()


class _DropForkRngWarning(logging.Filter):
    """The tracker's fork swaps the CPU generator on this runtime, so its
    'CPU RNG state changed within GPU RNG context' warning is expected, not a bug."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _move_tensor_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors that already are on the CPU:
    its original converts to NumPy only when it moves a CUDA tensor, so on the CPU the
    all-to-all dispatcher's splits stay tensors, which ``all_to_all_single`` refuses."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _get_cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. this function.
    torch.default_generator.manual_seed(int(seed))


def _leave_uncompiled(model: Any = None, **options: Any) -> Any:
    """``torch.compile`` as the identity, as a call and as a decorator factory."""
    return model if model is not None else (lambda function: function)


def import_megatron_uncompiled() -> None:
    """Import megatron-core with its ``jit_fuser`` functions left as plain Python.

    megatron decorates its fusable functions with ``torch.compile`` when its modules are
    imported. Decorating imports torch's compiler (dynamo and inductor), about 1.2 s of
    every rank's start on a CPU, while none of those functions is used on the CPU
    runtime: the fusions that call them are off without Transformer Engine
    (``models/gpt.py``), and the one that runs, the MoE router's expert-bias update, is a
    no-op unless ``moe_router_enable_expert_bias`` is set. ``torch.compile`` stands as
    the identity only while ``megatron.core`` is first imported, when megatron binds it as
    its ``jit_fuser``; it is restored before this returns. A process that has already
    imported megatron keeps what it has.
    """
    if "megatron.core" in sys.modules:
        return
    compile_function = torch.compile
    torch.compile = _leave_uncompiled
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_function


_lock = threading.Lock()
_state: dict[str, Any] = {"mode": None, "patches": None, "filter": None}


def cpu_runtime_enabled() -> bool:
    """Whether megatron's CUDA calls are currently redirected to the CPU."""
    return _state["mode"] is not None


def enable_cpu_runtime(*, allow_with_gpu: bool = False) -> None:
    """Redirect megatron-core's CUDA calls to the CPU for the rest of this process.

    Args:
        allow_with_gpu: the run explicitly asked for ``device: cpu`` on a machine that has
            a GPU. Without it, enabling on a CUDA machine is refused so a GPU run can never
            be silently moved to the CPU.
    """
    with _lock:
        if _state["mode"] is not None:
            return
        if torch.cuda.is_available() and not allow_with_gpu:
            raise RuntimeError(
                "refusing to enable the CPU runtime: CUDA is available. Set "
                "parallel.device=cpu to run on the CPU on purpose."
            )
        patches = _Patches()
        # Each replacement is a distinct function object: torch.compile's trace rules
        # index torch.cuda attributes by identity and refuse one object under two names.
        replacements: dict[str, Callable[..., Any]] = {
            "current_device": lambda: 0,
            "device_count": lambda: 0,
            "set_device": lambda *a, **k: None,
            "synchronize": lambda *a, **k: None,
            "empty_cache": lambda *a, **k: None,
            "manual_seed": lambda seed: _manual_seed(seed),
            "manual_seed_all": lambda seed: _manual_seed(seed),
            "get_rng_state": lambda *a, **k: torch.get_rng_state(),
            "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
            "Stream": _NullStream,
            "Event": _NullEvent,
            "current_stream": lambda *a, **k: _NullStream(),
            "default_stream": lambda *a, **k: _NullStream(),
            "stream": lambda *a, **k: contextlib.nullcontext(),
            "memory_allocated": lambda *a, **k: 0,
            "max_memory_allocated": lambda *a, **k: 0,
            "memory_reserved": lambda *a, **k: 0,
        }
        for name, value in replacements.items():
            patches.set(torch.cuda, name, value)
        for module_name, attrs in _MEGATRON_PATCHES.items():
            module = importlib.import_module(module_name)
            for name, value in attrs.items():
                patches.set(module, name, value)
        _redirect_in_backward(patches)
        mode = _CudaToCpuMode()
        mode.__enter__()
        log_filter = _DropForkRngWarning()
        logging.getLogger("megatron.core.tensor_parallel.random").addFilter(log_filter)
        _state.update(mode=mode, patches=patches, filter=log_filter)
        logger.debug("CPU runtime enabled: megatron CUDA calls now run on the CPU")


def disable_cpu_runtime() -> None:
    """Undo :func:`enable_cpu_runtime`; a no-op when it is not enabled."""
    with _lock:
        mode = _state["mode"]
        if mode is None:
            return
        mode.__exit__(None, None, None)
        _state["patches"].undo()
        logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_state["filter"])
        _state.update(mode=None, patches=None, filter=None)


def _redirect_in_backward(patches: _Patches) -> None:
    """The autograd engine runs a custom Function's backward without this thread's torch
    function modes, so a backward that allocates on ``torch.cuda.current_device()`` (as
    megatron's sequence-parallel reduce-scatter and all-to-all do) escapes the
    redirection: run every custom backward under the mode."""
    from torch.autograd.function import BackwardCFunction

    apply = BackwardCFunction.apply

    def redirected(self, *args):
        with _CudaToCpuMode():
            return apply(self, *args)

    patches.set(BackwardCFunction, "apply", redirected)


# Module-level functions in megatron that read CUDA generators directly (not through
# torch.cuda.*) or assume device tensors, replaced by their CPU equivalents.
_MEGATRON_PATCHES: dict[str, dict[str, Callable[..., Any]]] = {
    "megatron.core.tensor_parallel.random": {
        "_get_cuda_rng_state": _get_cpu_rng_state,
        "_set_cuda_rng_state": _set_cpu_rng_state,
    },
    # The all-to-all MoE token dispatcher's host copy of its split sizes (imported by name).
    "megatron.core.transformer.moe.token_dispatcher": {"maybe_move_tensor_to_cpu": _move_tensor_to_host},
}
