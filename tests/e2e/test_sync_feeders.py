"""Weight sync through Ray into two engines, each fed by its own actor rank (as on two
nodes), at layouts where the second feeder is another replica or another stage."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.config import config_from_dict
from dapo_megatron.orchestration.actor_group import ActorGroup
from dapo_megatron.orchestration.cluster import RayCluster
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.weight_sync.gather import feeder_roles
from tests.e2e.conftest import joined, run_config


def test_feeder_roles():
    # (rank, dp, tp, pp) of tp 2 x pp 2 x dp 2, megatron's order: tp fastest, then dp, then pp.
    ranks = [(r, (r // 2) % 2, r % 2, r // 4) for r in range(8)]
    leaders, valid = feeder_roles(ranks)
    assert leaders == [0, 4]
    assert valid == {0, 4, 2, 6}  # the stage leaders of each replica: each replica feeds from its own


def _synced_twice_into_two_engines(tiny_model, run_dir, address: str, parallel: dict, num_cpus: int, feeders=None):
    """Two colocated engines, the tiny model loaded into the actor at ``parallel``, synced
    twice (the second into the engines' swapped buffers): the last sync's statistics, each
    engine's served weights, and the model's own weights."""
    from safetensors.torch import load_file

    raw = run_config(tiny_model, run_dir, **{"rollout.num_engines": 2, "rollout.colocate": True})
    raw["parallel"].update(parallel)
    config = config_from_dict(joined(raw, address), "feeders")
    with RayCluster(config.ray, run_dir, num_cpus=num_cpus):
        actor, engines = ActorGroup(config), RolloutWorkers(config)
        try:
            actor.load_weights("hf", str(tiny_model / "model"))
            actor.sync_weights(engines.handles, 2**16, feeders=feeders)
            stats = actor.sync_weights(engines.handles, 2**16, feeders=feeders)
            served = [engines.served_weights(i) for i in range(2)]
        finally:
            engines.shutdown()
            actor.shutdown()
    return stats, served, load_file(str(tiny_model / "model/model.safetensors"))


def _assert_exactly(served: list[dict], expected: dict) -> None:
    for weights in served:
        assert set(weights) == set(expected)
        assert all(torch.equal(weights[name], expected[name]) for name in expected)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2)], ids=["second-replica", "second-stage"])
def test_two_engines_fed_by_two_ranks_get_exactly_the_model(tiny_model, tmp_path, shared_ray, tp, pp):
    # As if rank 1 and engine 1 were on a second node: rank 1 feeds engine 1.
    stats, served, expected = _synced_twice_into_two_engines(
        tiny_model, tmp_path / "run", shared_ray, {"tp_size": tp, "pp_size": pp}, 4, feeders={0: [0], 1: [1]}
    )
    assert stats.num_bytes == 2 * sum(t.nbytes for t in expected.values()) and stats.num_buckets > 4
    _assert_exactly(served, expected)


@pytest.mark.timeout(600)
def test_every_rank_feeds_its_own_pieces_to_two_engines_at_tp2_pp2(tiny_model, tmp_path, shared_ray):
    """The default colocated CPU sync: all four ranks (tp 2 x pp 2) send views of their own
    shards to both engines at once; each engine then serves exactly the model."""
    stats, served, expected = _synced_twice_into_two_engines(
        tiny_model, tmp_path / "run", shared_ray, {"tp_size": 2, "pp_size": 2, "num_devices_per_node": 4}, 6
    )
    # Each element is sent once (by the rank holding it), whatever the number of engines.
    assert stats.num_bytes == sum(t.nbytes for t in expected.values())
    assert stats.num_buckets >= 4  # every rank sent its own
    _assert_exactly(served, expected)
