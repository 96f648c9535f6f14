"""Placement across nodes, without a cluster: Ray's own ``Cluster`` simulates two nodes;
and one step at two layouts (dp 2 across the nodes, pp 2 on one) giving the same step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_megatron.config import config_from_dict
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import run_config


@pytest.fixture(scope="module")
def two_nodes():
    """A local Ray cluster of two simulated nodes (4 CPUs and 2): its address."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


def _one_step(tiny_model, run_dir: Path, address: str, inspect=None, **parallel) -> dict:
    """One step of the tiny model (no validation, no checkpoint) at ``parallel``, on the
    cluster at ``address``: the step's metrics."""
    raw = run_config(tiny_model, run_dir, **{"trainer.num_steps": 1, "trainer.val_before_train": False})
    raw["trainer"]["val_every"] = 0
    raw["checkpoint"]["save_every"] = 0
    raw["parallel"].update(parallel)
    raw["ray"] = {"address": address}
    assert train(config_from_dict(raw), inspect=inspect).steps == 1
    (line,) = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(line)


@pytest.fixture(scope="module")
def dp2_across_the_nodes(tiny_model, tmp_path_factory, two_nodes) -> tuple[dict, list]:
    """One step at dp 2, a rank on each node: its metrics and the nodes of the ranks."""
    import ray

    seen = {}

    def inspect(actor, engines):
        seen["rank_nodes"] = ray.get([rank.node_id.remote() for rank in actor.ranks])

    layout = dict(num_nodes=2, num_devices_per_node=1, tp_size=1)
    metrics = _one_step(tiny_model, tmp_path_factory.mktemp("dp2") / "run", two_nodes, inspect, **layout)
    return metrics, seen["rank_nodes"]


@pytest.mark.timeout(600)
def test_actor_ranks_land_on_both_nodes_and_a_step_completes(dp2_across_the_nodes):
    _, rank_nodes = dp2_across_the_nodes
    assert len(set(rank_nodes)) == 2, rank_nodes  # one rank on each simulated node


@pytest.mark.timeout(600)
def test_the_same_step_at_two_layouts(tiny_model, tmp_path, two_nodes, dp2_across_the_nodes):
    """One step through train at dp 2 (across the nodes) and at pp 2 (on one): the same
    rollouts, and the actor's loss, gradient norm and statistics equal up to float
    rounding (log-probs reassembled from data-parallel shards, the batch split over
    replicas, the stages' sync all agree)."""
    dp2, _ = dp2_across_the_nodes
    pp2 = _one_step(tiny_model, tmp_path / "pp2", two_nodes, num_nodes=1, num_devices_per_node=2, tp_size=1, pp_size=2)
    for key in ("reward/score_mean", "reward/accuracy", "response/length_mean", "dynamic_sampling/generated"):
        assert dp2[key] == pp2[key], key
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/approx_kl", "actor/gen_prob_mean"):
        assert pp2[key] == pytest.approx(dp2[key], rel=1e-5, abs=1e-9), key
    assert dp2["rollout/logprob_diff_max"] < 1e-4 and pp2["rollout/logprob_diff_max"] < 1e-4
