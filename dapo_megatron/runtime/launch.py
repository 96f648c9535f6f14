"""Launch the ranks of a run as local processes, the way torchrun would.

Tests, benchmarks and the single-machine CPU demo need several ranks on one machine
without an external launcher. :func:`launch_local` spawns ``nprocs`` fresh Python
processes (``spawn``, so no state leaks from the parent), sets the rendezvous variables
each rank reads in :func:`~dapo_megatron.runtime.distributed.initialize_runtime`, and
re-raises the first rank's failure with its traceback. Multi-node runs use torchrun or
Ray instead; the ranks see the same environment either way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from dapo_megatron.runtime.distributed import find_free_port


def _rank_entry(rank: int, target: Callable[..., Any], args: tuple, world_size: int, port: int, env: dict) -> None:
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
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    mp.start_processes(
        _rank_entry,
        args=(target, args, nprocs, find_free_port(), child_env),
        nprocs=nprocs,
        join=True,
        start_method="spawn",
    )
