"""Placement across nodes, without a cluster: Ray's own ``Cluster`` simulates two nodes."""

from __future__ import annotations

import pytest

from dapo_megatron.config import config_from_dict
from dapo_megatron.run.trainer import train
from tests.e2e.conftest import run_config


@pytest.mark.timeout(600)
def test_actor_ranks_land_on_both_nodes_and_a_step_completes(tiny_model, tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        config = run_config(
            tiny_model,
            tmp_path / "run",
            **{
                "trainer.num_steps": 1,
                "trainer.val_before_train": False,
                "trainer.val_every": 0,
                "checkpoint.save_every": 0,
            },
        )
        config["parallel"].update(num_nodes=2, num_devices_per_node=1, tp_size=1)  # dp 2 across the nodes
        config["ray"] = {"address": cluster.address}
        seen = {}

        def inspect(actor, engines):
            seen["rank_nodes"] = ray.get([rank.node_id.remote() for rank in actor.ranks])

        result = train(config_from_dict(config), inspect=inspect)
        assert result.steps == 1
        assert len(set(seen["rank_nodes"])) == 2, seen  # one rank on each simulated node
    finally:
        cluster.shutdown()
