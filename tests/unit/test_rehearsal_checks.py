"""The placement rehearsal's checks on hand-made maps, megatron's rank order, and the
plan of separate engines (their memory is not on the actor's GPUs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dapo_megatron.orchestration.placement import rank_coordinates
from dapo_megatron.orchestration.rehearsal import EnginePlace, RankPlace, Rehearsal, placement_problems

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "qwen2_5_32b" / "dapo.yaml"


def _good_map(colocate: bool = True) -> Rehearsal:
    """2 nodes x 4 GPUs, tp 2 x dp 4, as Ray lays them out; 2 engines of TP 4 (colocated, or on 2 spare nodes)."""
    ranks = [RankPlace(r, r % 2, 0, r // 2, r // 4, [r % 4], str(r % 4)) for r in range(8)]
    if colocate:
        engines = [EnginePlace(0, 0, [0, 1, 2, 3], 0, None, 0), EnginePlace(1, 1, [0, 1, 2, 3], 0, None, 4)]
    else:
        # Ray sets a separate engine's CUDA_VISIBLE_DEVICES to the GPUs it reserved.
        engines = [EnginePlace(0, 2, [0, 1, 2, 3], 0, "0,1,2,3", 0), EnginePlace(1, 3, [0, 1, 2, 3], 0, "0,1,2,3", 0)]
    nodes = [f"n{i}" for i in range(2 if colocate else 4)]
    return Rehearsal(2, 4, colocate, 4, nodes, ranks, engines)


def test_a_right_map_has_no_problem():
    assert placement_problems(_good_map(), tp_size=2) == []
    assert placement_problems(_good_map(colocate=False), tp_size=2) == []


def _with(rehearsal: Rehearsal, ranks=None, engines=None) -> Rehearsal:
    return dataclasses.replace(rehearsal, ranks=ranks or rehearsal.ranks, engines=engines or rehearsal.engines)


def test_each_wrong_placement_is_named():
    good = _good_map()
    ranks = list(good.ranks)
    ranks[1] = dataclasses.replace(ranks[1], gpus=[0], cuda_visible_devices="0")  # rank 1 on rank 0's GPU
    problems = placement_problems(_with(good, ranks=ranks), tp_size=2)
    assert "node 0 GPU 0 is used by 2 ranks [0, 1], not exactly one" in problems
    assert "node 0 GPU 1 is used by 0 ranks [], not exactly one" in problems

    ranks = list(good.ranks)
    ranks[2] = dataclasses.replace(ranks[2], cuda_visible_devices="0,1,2,3")
    assert placement_problems(_with(good, ranks=ranks), 2) == ["rank 2: CUDA_VISIBLE_DEVICES='0,1,2,3', not its GPU 2"]

    # A tensor-parallel group across nodes (rank 3 swapped with rank 4).
    ranks = list(good.ranks)
    ranks[3], ranks[4] = (
        dataclasses.replace(ranks[3], node=1, gpus=[0], cuda_visible_devices="0"),
        dataclasses.replace(ranks[4], node=0, gpus=[3], cuda_visible_devices="3"),
    )
    assert "the tensor-parallel group of pp 0, dp 1 spans nodes [0, 1]" in placement_problems(_with(good, ranks), 2)

    engines = [good.engines[0], dataclasses.replace(good.engines[1], node=0)]  # both engines on node 0's GPUs
    problems = placement_problems(_with(good, engines=engines), 2)
    assert "node 0 GPU 0 is used by engines [0, 1]" in problems
    assert "engine 1 on node 0 is fed by rank 4 on node 1 (CUDA IPC handles work within a node only)" in problems

    engines = [good.engines[0], dataclasses.replace(good.engines[1], gpus=[2, 3, 4, 5])]
    assert "engine 1's GPUs [2, 3, 4, 5] are not all on its node (GPUs 0-3)" in placement_problems(
        _with(good, engines=engines), 2
    )
    engines = [dataclasses.replace(good.engines[0], gpus=[0, 1]), good.engines[1]]
    assert placement_problems(_with(good, engines=engines), 2) == ["engine 0 has GPUs [0, 1], not engine_tp_size=4"]
    engines = [dataclasses.replace(good.engines[0], feeder=None), good.engines[1]]
    assert placement_problems(_with(good, engines=engines), 2) == ["engine 0 has no feeder"]

    separate = _good_map(colocate=False)
    engines = [dataclasses.replace(separate.engines[0], node=1), separate.engines[1]]
    assert placement_problems(_with(separate, engines=engines), 2) == [
        "engine 0 (separate) uses GPUs [0, 1, 2, 3] of actor ranks on node 1"
    ]


@pytest.mark.parametrize("tp,cp,pp,world", [(8, 1, 2, 128), (2, 1, 2, 8), (1, 1, 4, 8), (2, 2, 1, 8), (4, 1, 1, 4)])
def test_rank_coordinates_follow_megatrons_rank_generator(tp, cp, pp, world):
    from megatron.core.parallel_state import RankGenerator

    from dapo_megatron.config import ParallelConfig

    dp = world // (tp * cp * pp)
    parallel = ParallelConfig(num_nodes=1, num_devices_per_node=world, tp_size=tp, pp_size=pp, cp_size=cp)
    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for token, key in (("tp", "tp_rank"), ("cp", "cp_rank"), ("dp", "dp_rank"), ("pp", "pp_rank")):
        for group in generator.get_ranks(token):
            for position, rank in enumerate(group):
                assert rank_coordinates(parallel, rank)[key] == position, (token, rank)


def test_separate_engines_add_no_memory_to_the_actors_gpus():
    from dapo_megatron.config import load_config
    from dapo_megatron.plan import estimate_memory

    layout = ["parallel.num_nodes=2", "rollout.num_engines=4", "rollout.gpu_memory_utilization=0.5"]
    colocated = estimate_memory(load_config(RECIPE, layout))
    separate = estimate_memory(load_config(RECIPE, [*layout, "rollout.colocate=false"]))
    # Separate engines: no SGLang share, staging buffers or workers' contexts on the actor's
    # GPUs; rank 0 keeps the weight-update communicator instead.
    assert colocated.sglang > 0 and separate.update_group > 0
    on_colocated = colocated.sglang + colocated.sync_staging + colocated.engine_contexts
    assert separate.rollout_phase - separate.update_group == colocated.rollout_phase - on_colocated
    assert separate.train_phase - separate.update_group == colocated.train_phase - on_colocated + colocated.sglang


def test_the_rehearsals_worker_setup_starts_the_worker_as_rays_would():
    """Ray's setup script applies the runtime env's variables (``${X}`` expanded, unknown
    ones empty) and execs the worker with the remaining arguments; the rehearsal's does the
    same without importing Ray, and refuses what it does not handle."""
    from dapo_megatron.orchestration.rehearsal_worker_setup import worker_command

    context = '{"env_vars": {"A": "1", "B": "${HOME}/x", "C": "${NOPE_NOT_SET}y"}, "py_executable": "/py"}'
    argv = [
        "-s",
        "/ray/default_worker.py",
        "--node-ip-address=1.2.3.4",
        f"--serialized-runtime-env-context={context}",
        "--language=PYTHON",
        "--startup-token=7",
    ]
    command, env = worker_command(argv, {"HOME": "/home/u"})
    assert command == ["/py", "-s", "/ray/default_worker.py", "--node-ip-address=1.2.3.4", "--startup-token=7"]
    assert env["A"] == "1" and env["C"] == "y" and env["B"].endswith("/x")
    with pytest.raises(SystemExit, match="plain Python workers only"):
        worker_command(["w.py", "--language", "JAVA"], {})
    with pytest.raises(SystemExit, match="plain Python workers only"):
        worker_command(["w.py", '--serialized-runtime-env-context={"command_prefix": ["conda", "run"]}'], {})
