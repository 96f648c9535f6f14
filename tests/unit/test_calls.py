"""A group's start never waits forever for a member Ray cannot place."""

from __future__ import annotations

import re
import time

import pytest
import ray

from dapo_megatron.orchestration.group_calls import MemberFailed, call_all


@ray.remote
class _Member:
    def work(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"


@pytest.fixture(scope="module")
def one_cpu_cluster(tmp_path_factory):
    ray.init(address="local", num_cpus=1, num_gpus=0, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def test_a_member_that_cannot_be_placed_is_named_as_not_started(one_cpu_cluster):
    placed = _Member.options(num_cpus=0).remote()
    unplaceable = _Member.options(num_cpus=0, num_gpus=1).remote()  # no node has a GPU
    members = [placed, unplaceable]
    start = time.monotonic()
    with pytest.raises(MemberFailed) as caught:
        call_all(
            [m.work.remote(0) for m in members],
            "rollout engine",
            ["rollout engine 0", "rollout engine 1"],
            members=members,
            asked="num_cpus 0, num_gpus 1",
            schedule_timeout_s=3,
        )
    assert time.monotonic() - start < 30
    message = str(caught.value)
    # The placed member started within the first 3 s: the wait went on for 3 s more.
    assert re.match(
        r"1 of 2 rollout engine\(s\) not started after \d+ s, none of them in the last 3 s \(rollout engine 1\)",
        message,
    ), message
    assert (
        "(each asks for num_cpus 0, num_gpus 1); the cluster has 1 CPU free of 1, 0 GPU free of 0 on 1 node(s)"
        in message
    )
    ray.kill(unplaceable)


def test_placed_members_may_take_longer_than_the_placement_bound(one_cpu_cluster):
    members = [_Member.options(num_cpus=0).remote() for _ in range(2)]
    call_all([m.work.remote(0) for m in members], "actor rank")  # both started
    refs = [m.work.remote(2) for m in members]
    assert call_all(refs, "actor rank", members=members, schedule_timeout_s=1) == ["done", "done"]


@ray.remote(num_cpus=0)
class _SlowToStart:
    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)  # Ray reports it not started until this returns

    def work(self) -> str:
        return "done"


def test_a_start_that_keeps_making_progress_is_not_cut_short(one_cpu_cluster):
    """Members that come up one after another, each later than the bound from the first
    call, as many stand-ins do on two cores: the wait goes on while any starts."""
    members = [_SlowToStart.remote(seconds) for seconds in (1.0, 3.5, 6.0)]
    refs = [m.work.remote() for m in members]
    assert call_all(refs, "stand-in", members=members, schedule_timeout_s=3.5) == ["done"] * 3
