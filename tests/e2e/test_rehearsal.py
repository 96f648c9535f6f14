"""``plan --rehearse``: the job placed on a simulated GPU cluster (a local Ray instance of
one raylet per declared node, no GPU needed) through the code ``train`` runs, with
stand-in ranks and engines; the layouts of the 32B recipe, and what cannot be placed."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import psutil
import pytest

from dapo_megatron.cli import main
from dapo_megatron.config import load_config
from dapo_megatron.orchestration.group_calls import MemberFailed
from tests.e2e.conftest import LOOPBACK, listening_sockets, ray_client

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "qwen2_5_32b" / "dapo.yaml"
FITS = "rollout.gpu_memory_utilization=0.35"  # the plan's memory check, at 2 nodes instead of 16 (dp 1)


def _rehearse_cli(capsys, *overrides: str) -> subprocess.CompletedProcess:
    """``dapo-megatron plan RECIPE FITS *overrides --rehearse``, run by the command line's
    own ``main`` in this process (an interpreter's start less); its status and output."""
    capsys.readouterr()
    status = main(["plan", str(RECIPE), FITS, *overrides, "--rehearse"])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([], status, out, err)


def _node_blocks(text: str) -> dict[int, str]:
    parts = re.split(r"\n  node (\d+) ", text)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def test_the_recipes_node_layout_places_two_tp4_engines_on_each_node_fed_from_it(capsys):
    """The recipe's own layout (tp 8 x pp 2, 8 GPUs a node, 2 colocated engines of TP 4
    per node) on 2 of its 16 nodes: every rank on its own GPU, as Ray sets
    CUDA_VISIBLE_DEVICES; engines on GPUs 0-3 and 4-7, fed by their node's stage leader."""
    done = _rehearse_cli(capsys, "parallel.num_nodes=2", "rollout.num_engines=4")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "16 rank(s), 4 engine(s) placed" in out
    blocks = _node_blocks(out)
    assert sorted(blocks) == [0, 1]
    for node, block in blocks.items():
        leader = 8 * node  # pp stage `node`'s tensor-parallel rank 0
        # Ray hands a bundle's GPUs out in the order the ranks' leases arrive: any GPU, one each.
        places = re.findall(r"GPU(\d): r(\d+) \(tp(\d+) pp(\d+) dp(\d+)\)", block)
        assert sorted(int(gpu) for gpu, *_ in places) == list(range(8))
        assert sorted((int(r), int(tp), int(pp), int(dp)) for _, r, tp, pp, dp in places) == [
            (8 * node + tp, tp, node, 0) for tp in range(8)
        ]
        assert f"engine {2 * node}: GPUs 0-3 (base_gpu_id 0), sees all of the node's, fed by rank {leader}" in block
        assert f"engine {2 * node + 1}: GPUs 4-7 (base_gpu_id 4), sees all of the node's, fed by rank {leader}" in block
    assert "Placement checks passed" in out


def test_separate_engines_land_on_spare_nodes_and_wider_engines_fill_a_node(capsys):
    """Separate engines (rollout.colocate=false) on spare nodes of their own, on GPUs no
    rank uses; then engines of TP 8, one per node of a tp 8 x pp 2 layout."""
    separate = _rehearse_cli(
        capsys,
        "parallel.num_nodes=2",
        "parallel.num_devices_per_node=4",
        "parallel.tp_size=4",
        "rollout.colocate=false",
        "rollout.num_engines=2",
        "rollout.engine_tp_size=4",
    )
    assert separate.returncode == 0, separate.stderr[-3000:]
    blocks = _node_blocks(separate.stdout)
    assert "(2 for the actor, 2 spare)" in separate.stdout
    assert "(spare;" in blocks[2] and "(spare;" in blocks[3]
    assert (blocks[2] + blocks[3]).count("GPUs 0-3 (base_gpu_id 0)") == 2
    assert "engine" not in blocks[0] and "engine" not in blocks[1]
    assert "separate engines use GPUs no rank uses" in separate.stdout

    wide = _rehearse_cli(capsys, "parallel.num_nodes=2", "rollout.num_engines=2", "rollout.engine_tp_size=8")
    assert wide.returncode == 0, wide.stderr[-3000:]
    blocks = _node_blocks(wide.stdout)
    assert "engine 0: GPUs 0-7 (base_gpu_id 0)" in blocks[0] and "engine 1: GPUs 0-7 (base_gpu_id 0)" in blocks[1]


def _one_node_of_four_gpus(*overrides: str):
    """The recipe on one node of 4 GPUs (tp 4) with one engine of TP 4."""
    layout = ["parallel.num_nodes=1", "parallel.num_devices_per_node=4", "parallel.tp_size=4", "parallel.pp_size=1"]
    return load_config(RECIPE, [FITS, *layout, "rollout.num_engines=1", "rollout.engine_tp_size=4", *overrides])


def test_what_cannot_be_placed_is_refused_within_the_bound_naming_what_it_asks():
    """Separate engines without a spare node: Ray can never start them; the rehearsal
    names them and what they ask for within its bound, instead of waiting."""
    from dapo_megatron.orchestration.rehearsal import rehearse

    config = _one_node_of_four_gpus("rollout.colocate=false")
    with pytest.raises(
        MemberFailed, match=r"1 of 1 rollout engine\(s\) not started after 3 s .*num_gpus 4.*0 GPU free of 4"
    ):
        rehearse(config, spare_nodes=0, schedule_timeout_s=3)


def test_the_old_recipe_placement_would_not_start(monkeypatch):
    """Negative control: colocated engines asking for a GPU share outside the actor's
    placement group (the recipe's placement before it was fixed) are never started by
    Ray, and the rehearsal says so."""
    from dapo_megatron.orchestration import rollout
    from dapo_megatron.orchestration.rehearsal import rehearse

    def outside_the_group(config, placement_group=None):
        return [({"num_cpus": 1, "num_gpus": 0.2}, None) for _ in range(config.rollout.num_engines)]

    monkeypatch.setattr(rollout, "engine_placements", outside_the_group)
    config = _one_node_of_four_gpus()
    with pytest.raises(MemberFailed, match=r"rollout engine\(s\) not started after 3 s"):
        rehearse(config, schedule_timeout_s=3)


def test_more_engines_than_the_gpus_hold_are_refused_before_anything_starts(capsys):
    assert main(["plan", str(RECIPE), "rollout.num_engines=48", "--rehearse"]) == 2
    assert "rollout.num_engines x rollout.engine_tp_size" in capsys.readouterr().err


def test_the_rehearsal_cluster_listens_on_loopback_and_needs_a_token():
    """The simulated cluster runs whatever a client that reaches it submits, as the user
    (train.sbatch rehearses on the head node before the job's own token exists): every
    listener of its processes is on the loopback address, and a client needs its token,
    a fresh one only the user can read, gone when it stops. Two declared nodes, so an
    added raylet is checked as well as the head's processes."""
    import ray

    from dapo_megatron.orchestration.rehearsal import declared_cluster

    before = {k: v for k, v in os.environ.items() if k.startswith(("RAY_AUTH", "RAY_ENABLE"))}
    with declared_cluster(num_nodes=2, gpus_per_node=0, cpus_per_node=1):
        assert len([node for node in ray.nodes() if node["Alive"]]) == 2
        address = ray.get_runtime_context().gcs_address
        listening = listening_sockets(psutil.Process())
        assert sum(s.name.startswith("raylet") for s in listening if s.kind == "tcp") >= 2, listening
        assert all(s.ip in LOOPBACK for s in listening), [s for s in listening if s.ip not in LOOPBACK]
        assert address.startswith("127.0.0.1:"), address
        assert os.environ.get("RAY_AUTH_MODE") == "token", os.environ.get("RAY_AUTH_MODE")
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.stat().st_uid == os.getuid()
        refused = ray_client(address)
        assert refused.returncode != 0 and "CONNECTED" not in refused.stdout, refused.stdout
        assert "Authentication token is missing or incorrect" in refused.stderr, refused.stderr[-2000:]
        allowed = ray_client(address, token)
        assert allowed.returncode == 0 and "CONNECTED 2.0" in allowed.stdout, allowed.stderr[-2000:]
    assert not token.exists()
    assert {k: v for k, v in os.environ.items() if k.startswith(("RAY_AUTH", "RAY_ENABLE"))} == before


def test_evals_engines_of_the_recipe_take_whole_gpus_spread_over_its_nodes():
    """``dapo-megatron eval`` of the 32B recipe has no actor and so no placement group:
    its engines of TP 4 are placed on the recipe's nodes (8 GPUs, 32 CPUs each, as a real
    node declares many; 4 of its 16 nodes and 8 of its 32 engines here), two per node,
    each on 4 GPUs of its node that no other engine uses and that its process sees.
    (Asking for a GPU share, as eval once did, Ray packed them onto the head node and the
    start raised.)"""
    from dapo_megatron.orchestration.rehearsal import rehearse_eval

    rehearsal = rehearse_eval(load_config(RECIPE, [FITS, "parallel.num_nodes=4", "rollout.num_engines=8"]))
    assert rehearsal.problems == []
    assert len(rehearsal.node_ids) == 4 and len(rehearsal.engines) == 8
    assert sorted(e.index for e in rehearsal.engines) == list(range(8))
    per_node = {node: [e for e in rehearsal.engines if e.node == node] for node in range(4)}
    assert all(len(engines) == 2 for engines in per_node.values()), {n: len(e) for n, e in per_node.items()}
    for engines in per_node.values():
        used = sorted(gpu for engine in engines for gpu in engine.gpus)
        assert used == list(range(8))  # 2 engines x 4 GPUs: every GPU of the node once
        for engine in engines:
            assert len(engine.gpus) == 4 and engine.base_gpu_id == 0
            assert engine.cuda_visible_devices == ",".join(map(str, engine.gpus))
