"""Where rollout engines go: GPU slots per node, feeders, and a placement on a Ray
instance that declares GPUs."""

from __future__ import annotations

import os
import types

import pytest
import ray

from dapo_megatron.orchestration.placement import engine_start_gpus


def _engines_config(**rollout):
    """What the placement functions read of a config: its rollout and parallel sections."""
    from dapo_megatron.config import ParallelConfig, RolloutConfig

    return types.SimpleNamespace(rollout=RolloutConfig(**rollout), parallel=ParallelConfig(device="cuda"))


def test_separate_engines_start_on_the_gpus_ray_reserved_whatever_their_ids():
    def config(colocate: bool, engine: str = "sglang"):
        return _engines_config(engine=engine, engine_tp_size=4, colocate=colocate)

    # Ray sets CUDA_VISIBLE_DEVICES to the reserved ids: SGLang starts on the first it sees.
    assert engine_start_gpus(config(False), None, [7, 1, 5, 3]) == (0, [1, 3, 5, 7])
    assert engine_start_gpus(config(False), None, [4, 5, 6, 7]) == (0, [4, 5, 6, 7])
    with pytest.raises(ValueError, match=r"needs 4 GPUs of its own; Ray reserved \[1, 3\]"):
        engine_start_gpus(config(False), None, [3, 1])
    # Colocated: given a first GPU among all the node's; the transformers engine: none.
    assert engine_start_gpus(config(True), 4, []) == (4, [4, 5, 6, 7])
    assert engine_start_gpus(config(True, "hf"), None, []) == (None, [])


def test_actor_ranks_take_on_sglangs_nccl_settings_only_beside_separate_engines():
    from dapo_megatron.orchestration.placement import nccl_env_like_sglang

    def config(colocate: bool):
        return _engines_config(engine="sglang", colocate=colocate)

    assert nccl_env_like_sglang(config(False), {}) == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    # A value the job sets reaches SGLang's processes too, which keep it: so do the ranks.
    assert nccl_env_like_sglang(config(False), {"NCCL_CUMEM_ENABLE": "1"}) == {"NCCL_NVLS_ENABLE": "0"}
    assert nccl_env_like_sglang(config(True), {}) == {}


def test_each_engine_is_fed_from_its_own_gpus_else_its_node():
    from dapo_megatron.orchestration.placement import choose_feeders

    # Two nodes of 8 GPUs, 16 ranks (rank r on GPU r % 8 of node r // 8); ranks 0 and 8
    # are stage leaders of the first replica, ranks 4..7 and 12..15 belong to another replica.
    ranks = [("a" if r < 8 else "b", [r % 8]) for r in range(16)]
    valid = {0, 8, *range(4, 8), *range(12, 16)}
    engines = [("a", [0, 1, 2, 3]), ("a", [4, 5, 6, 7]), ("b", [0, 1, 2, 3]), ("b", [4, 5, 6, 7])]
    assert choose_feeders(engines, ranks, valid) == {0: [0], 4: [1], 8: [2], 12: [3]}
    # No valid feeder on an engine's GPUs: the lowest on its node; none on the node: rank 0.
    assert choose_feeders([("a", [2, 3]), ("c", [0])], ranks, {0, 8, 5}) == {0: [0, 1]}
    assert choose_feeders([("a", [2, 3])], ranks, {5, 8}) == {5: [0]}
    # The CPU runtime: no GPUs anywhere, the lowest valid rank on the node.
    assert choose_feeders([("a", []), ("a", [])], [("a", []), ("a", [])], {0, 1}) == {0: [0, 1]}


def test_colocated_slots_spread_evenly_and_refuse_what_does_not_fit():
    from dapo_megatron.orchestration.placement import colocated_engine_slots

    # The 32B recipe: 16 nodes x 8 GPUs, 32 engines of TP 4: two per node, on GPUs 0-3 and 4-7.
    slots = colocated_engine_slots(32, 4, 16, 8)
    assert slots[:4] == [(0, 0), (0, 4), (1, 0), (1, 4)] and slots[-1] == (15, 4)
    assert sorted(set(slots)) == sorted(slots)  # no two engines share a first GPU on a node
    with pytest.raises(ValueError, match=r"rollout.num_engines=33 colocated engines do not spread evenly over"):
        colocated_engine_slots(33, 4, 16, 8)
    with pytest.raises(
        ValueError, match=r"3 colocated engines of engine_tp_size=4 per node need 12 GPUs, a node has 8"
    ):
        colocated_engine_slots(48, 4, 16, 8)


@ray.remote
class _WhereAmI:
    """A stand-in engine or rank: reports where Ray put it."""

    def report(self) -> dict:
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [int(i) for i in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }


def test_colocated_gpu_engines_start_inside_the_actors_reservation(tmp_path):
    """On a Ray instance that declares 4 GPUs (none exist), the actor's placement group
    reserves all of them for its 4 ranks, as ActorGroup does. Engines placed by
    engine_placements start at once, see every GPU (Ray leaves CUDA_VISIBLE_DEVICES
    alone) and are given GPUs 0-1 and 2-3; an engine asking for a GPU share outside the
    group, as before, is never started."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from dapo_megatron.config import config_from_dict
    from dapo_megatron.orchestration.rollout import engine_placements

    config = config_from_dict(
        {
            "model": {
                "num_layers": 2,
                "hidden_size": 64,
                "ffn_hidden_size": 128,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "vocab_size": 128,
                "max_position_embeddings": 64,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
            },
            "parallel": {"device": "cuda", "num_devices_per_node": 4, "tp_size": 2},
            "rollout": {"engine": "sglang", "colocate": True, "num_engines": 2, "engine_tp_size": 2},
        }
    )
    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        group = placement_group([{"CPU": 4, "GPU": 4}], strategy="STRICT_PACK")
        ray.get(group.ready(), timeout=60)
        in_group = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)
        ranks = [_WhereAmI.options(num_cpus=1, num_gpus=1, scheduling_strategy=in_group).remote() for _ in range(4)]
        rank_places = ray.get([r.report.remote() for r in ranks], timeout=60)
        assert sorted(g for p in rank_places for g in p["gpu_ids"]) == [0, 1, 2, 3]

        placements = engine_placements(config, group)
        assert [base for _, base in placements] == [0, 2]
        engines = [_WhereAmI.options(**options).remote() for options, _ in placements]
        engine_places = ray.get([e.report.remote() for e in engines], timeout=60)
        assert all(p["node"] == rank_places[0]["node"] for p in engine_places)
        assert all(p["gpu_ids"] == [] and p["cuda_visible_devices"] is None for p in engine_places)

        outside = _WhereAmI.options(num_cpus=0, num_gpus=0.2).remote()  # the earlier placement
        done, _ = ray.wait([outside.report.remote()], timeout=5)
        assert not done  # the group holds every GPU: never granted
    finally:
        ray.shutdown()
