"""Weight sync through Ray into two engines, each fed by its own actor rank (as on two
nodes), at layouts where the second feeder is another replica or another stage.

The module's two engines start once; each test's actor, at its own layout, loads a model
of its own (the tiny model's shapes, weights of their own seed) and syncs it into them, so
an engine serving exactly that model got it from that test's sync."""

from __future__ import annotations

import shutil

import pytest
import torch

from dapo_megatron.config import config_from_dict
from dapo_megatron.orchestration.actor_group import ActorGroup
from dapo_megatron.orchestration.cluster import RayCluster
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.weight_sync.gather import feeder_roles
from tests.e2e.conftest import driver_of, joined, run_config


def test_feeder_roles():
    # (rank, dp, tp, pp) of tp 2 x pp 2 x dp 2, megatron's order: tp fastest, then dp, then pp.
    ranks = [(r, (r // 2) % 2, r % 2, r // 4) for r in range(8)]
    leaders, valid = feeder_roles(ranks)
    assert leaders == [0, 4]
    assert valid == {0, 4, 2, 6}  # the stage leaders of each replica: each replica feeds from its own


def _config(tiny_model, run_dir, address: str, parallel: dict):
    raw = run_config(tiny_model, run_dir, **{"rollout.num_engines": 2, "rollout.colocate": True})
    raw["parallel"].update(parallel)
    return config_from_dict(joined(raw, address), "feeders")


@pytest.fixture(scope="module")
def two_engines(tiny_model, tmp_path_factory, _shared_ray_head):
    """Two colocated engines serving the tiny model, on the package's Ray head, and the
    head's address for the tests' actors."""
    run_dir = tmp_path_factory.mktemp("feeders") / "engines"
    with driver_of(_shared_ray_head) as address:
        config = _config(tiny_model, run_dir, address, {})
        with RayCluster(config.ray, run_dir, num_cpus=6):
            engines = RolloutWorkers(config)
            try:
                yield engines, address
            finally:
                engines.shutdown()


def _model_of_seed(tiny_model, folder, seed: int):
    """The tiny model's folder (config, tokenizer) with weights drawn from ``seed``: its
    folder and its weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_model / "model", folder)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_pretrained(folder).apply(_redrawn).save_pretrained(folder)
    return folder, load_file(str(folder / "model.safetensors"))


def _redrawn(module) -> None:
    for parameter in module.parameters(recurse=False):
        with torch.no_grad():
            parameter.normal_(0, 0.05)


def _synced_twice(tiny_model, two_engines, tmp_path, seed: int, parallel: dict, feeders=None):
    """A model of ``seed`` loaded into an actor at ``parallel`` and synced twice into the
    module's engines (the second into their swapped buffers): the last sync's statistics,
    each engine's served weights, and the model's own weights."""
    engines, address = two_engines
    folder, expected = _model_of_seed(tiny_model, tmp_path / "model", seed)
    actor = ActorGroup(_config(tiny_model, tmp_path / "run", address, parallel))
    try:
        actor.load_weights("hf", str(folder))
        actor.sync_weights(engines.handles, 2**16, feeders=feeders)
        stats = actor.sync_weights(engines.handles, 2**16, feeders=feeders)
        served = [engines.served_weights(i) for i in range(2)]
    finally:
        actor.shutdown()
    return stats, served, expected


def _assert_exactly(served: list[dict], expected: dict) -> None:
    for weights in served:
        assert set(weights) == set(expected)
        assert all(torch.equal(weights[name], expected[name]) for name in expected)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("tp", "pp", "seed"), [(1, 1, 1), (1, 2, 2)], ids=["second-replica", "second-stage"])
def test_two_engines_fed_by_two_ranks_get_exactly_the_model(tiny_model, tmp_path, two_engines, tp, pp, seed):
    # As if rank 1 and engine 1 were on a second node: rank 1 feeds engine 1.
    stats, served, expected = _synced_twice(
        tiny_model, two_engines, tmp_path, seed, {"tp_size": tp, "pp_size": pp}, feeders={0: [0], 1: [1]}
    )
    assert stats.num_bytes == 2 * sum(t.nbytes for t in expected.values()) and stats.num_buckets > 4
    _assert_exactly(served, expected)


@pytest.mark.timeout(600)
def test_every_rank_feeds_its_own_pieces_to_two_engines_at_tp2_pp2(tiny_model, tmp_path, two_engines):
    """The default colocated CPU sync: all four ranks (tp 2 x pp 2) send views of their own
    shards to both engines at once; each engine then serves exactly the model."""
    stats, served, expected = _synced_twice(
        tiny_model, two_engines, tmp_path, 3, {"tp_size": 2, "pp_size": 2, "num_devices_per_node": 4}
    )
    # Each element is sent once (by the rank holding it), whatever the number of engines.
    assert stats.num_bytes == sum(t.nbytes for t in expected.values())
    assert stats.num_buckets >= 4  # every rank sent its own
    _assert_exactly(served, expected)
