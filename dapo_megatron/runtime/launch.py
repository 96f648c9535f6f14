"""Launch the ranks of a run as local processes, the way torchrun would.

Tests, benchmarks and the single-machine CPU demo need several ranks on one machine
without an external launcher. :func:`launch_local` starts ``nprocs`` rank processes,
sets the rendezvous variables each rank reads in
:func:`~dapo_megatron.runtime.distributed.initialize_runtime`, and re-raises the first
rank's failure with its traceback. Multi-node runs use torchrun or Ray instead; the ranks
see the same environment either way.

The ranks are forked from multiprocessing's *forkserver*: a clean process (not the
caller, so no state leaks from it, as with ``spawn``) that imports torch, transformers and
megatron-core once (:data:`PRELOAD`) and is reused by every later launch of the caller.
A spawned rank imports them itself, about 10 s of CPU each on a small machine: a test
suite that launches a few hundred ranks spent most of its time there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from dapo_megatron.runtime.distributed import find_free_port

PRELOAD = ("torch", "transformers", "megatron.core", "dapo_megatron.actor.megatron_actor")
"""What the forkserver imports once for every rank it forks (an import that fails there
is skipped, and the rank imports it itself)."""


def _rank_entry(rank: int, target: Callable[..., Any], args: tuple, world_size: int, port: int, env: dict) -> None:
    # The caller's environment as it is now (the forkserver holds the one of its start).
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    target(*args)


def launch_local(
    target: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    env: dict[str, str] | None = None,
) -> None:
    """Run ``target(*args)`` in ``nprocs`` local rank processes and wait for all of them.

    ``target`` must be importable by name (a module-level function). Each process gets
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, plus
    ``env``. Raises ``torch.multiprocessing.ProcessRaisedException`` (with the rank's
    traceback) or ``ProcessExitedException`` when a rank fails.
    """
    # One thread per rank: the ranks share the machine's cores.
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # Only takes effect before the forkserver's first start; later launches reuse it.
    mp.set_forkserver_preload(list(PRELOAD))
    mp.start_processes(
        _rank_entry,
        args=(target, args, nprocs, find_free_port(), child_env),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )
