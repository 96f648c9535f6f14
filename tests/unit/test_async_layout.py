"""``train`` says when asynchronous generation competes with training for the same
devices (where measured, it then made steps slower than synchronous ones)."""

from __future__ import annotations

import os

import pytest

from dapo_megatron.config import Config
from dapo_megatron.orchestration.cluster import async_shares_devices


def _demo_layout(asynchronous: bool, **ray) -> Config:
    config = Config()
    config.parallel.device = "cpu"
    config.parallel.num_devices_per_node = 2
    config.rollout.num_engines = 1
    config.trainer.async_generation = asynchronous
    for key, value in ray.items():
        setattr(config.ray, key, value)
    return config


@pytest.mark.parametrize(("cores", "shared"), [(2, True), (3, False), (8, False)])
def test_cpu_async_warns_only_when_ranks_and_engines_share_cores(monkeypatch, cores, shared):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    why = async_shares_devices(_demo_layout(True))
    assert (why is not None) == shared
    if shared:
        assert "2 actor rank(s) and 1 engine(s) share this machine's 2 cores" in why
    # Pinning turned off: shared whatever the cores; synchronous runs never warn.
    assert async_shares_devices(_demo_layout(True, separate_cores=False)) is not None
    assert async_shares_devices(_demo_layout(False)) is None


def test_gpu_async_warns_when_engines_are_colocated():
    config = _demo_layout(True)
    config.parallel.device = "cuda"
    config.rollout.colocate = True
    assert "colocated" in async_shares_devices(config)
    config.rollout.colocate = False
    assert async_shares_devices(config) is None
