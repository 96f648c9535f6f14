"""Measurement primitives that run inside any process of the system (actor ranks,
engines, the driver): a matmul's and a copy's throughput on this device, and the
process's peak memory, resettable so each benchmark phase gets its own peak; and the
phase timer every step's ``time/<phase>`` metrics come from.

``dapo-megatron bench`` (:mod:`dapo_megatron.bench`) calls them in the processes that do
the work, so a ceiling is measured where, and under the contention in which, the phase
it judges runs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator peak on a GPU; the process's resident-set
    high-water mark on the CPU (Linux ``clear_refs``; a no-op where that is refused)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """The peak since :func:`reset_peak_memory`: bytes the CUDA allocator held on a GPU,
    the process's peak resident set on the CPU (0 where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


def take_peak_memory(device: torch.device, reset: bool) -> int:
    """:func:`peak_memory_bytes`, then (``reset``) :func:`reset_peak_memory`: what a
    process reports when asked for one phase's peak."""
    peak = peak_memory_bytes(device)
    if reset:
        reset_peak_memory(device)
    return peak


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops_per_s(
    shapes: list[tuple[int, int]], tokens: int, dtype: torch.dtype, device: torch.device, repeats: int = 3
) -> float:
    """FLOP/s of ``[tokens, in] @ [in, out]`` over ``shapes`` (``(in, out)`` pairs), the
    best of ``repeats`` passes after one warm-up pass."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    operands = [
        (
            torch.randn(tokens, n_in, generator=gen).to(device=device, dtype=dtype),
            torch.randn(n_in, n_out, generator=gen).to(device=device, dtype=dtype),
        )
        for n_in, n_out in shapes
    ]
    flops = sum(2 * tokens * n_in * n_out for n_in, n_out in shapes)
    best = float("inf")
    for attempt in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        for left, right in operands:
            torch.mm(left, right)
        _synchronize(device)
        if attempt:  # the first pass warms up the kernels and the allocator
            best = min(best, time.perf_counter() - start)
    return flops / best


def copy_bytes_per_s(num_bytes: int, device: torch.device, repeats: int = 3) -> float:
    """Bytes per second of ``dst.copy_(src)`` over ``num_bytes`` (both already touched),
    best of ``repeats``."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


@contextmanager
def timed(times: dict[str, float], phase: str) -> Iterator[None]:
    """Add the block's wall time to ``times[phase]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        times[phase] = times.get(phase, 0.0) + time.perf_counter() - start
