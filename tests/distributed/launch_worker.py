"""Rank functions for the launcher's own test: what a rank sees of its environment."""

from __future__ import annotations

import json
import os
import sys


def report_environment(path: str) -> None:
    """Each rank writes its rendezvous variables, a caller's variable, its thread count
    and whether torch came preloaded (imported before this function ran)."""
    import torch

    record = {
        "rank": os.environ["RANK"],
        "world_size": os.environ["WORLD_SIZE"],
        "marker": os.environ.get("DAPO_TEST_MARKER"),
        "threads": torch.get_num_threads(),
        "megatron_preloaded": "megatron.core" in sys.modules,
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }
    with open(f"{path}.{record['rank']}", "w") as handle:
        json.dump(record, handle)
