"""What the runtime's groups listen on: the rendezvous store on its address only (torch's
own server would take every interface), gloo's pair listeners on the interface towards
the rendezvous, and launches whose address other nodes could not reach refused."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import psutil
import pytest
import torch
import torch.multiprocessing as mp

from dapo_megatron.cli import main
from dapo_megatron.config import ParallelConfig, load_config
from dapo_megatron.plan import network_plan
from dapo_megatron.runtime.distributed import (
    GLOO_IFNAME,
    LaunchError,
    find_free_port,
    gloo_interface,
    interface_of,
    rendezvous_from_env,
    rendezvous_store,
)
from dapo_megatron.weight_sync.update_group import init_weight_update_group

TIMEOUT = datetime.timedelta(seconds=60)
NOT_OURS = "203.0.113.7"  # TEST-NET-3: never an address of this machine
DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo" / "demo.yaml"


def _listening(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN or (c.laddr and c.laddr.port and not c.raddr)
    ]


def test_the_store_listens_on_its_address_only_and_serves_its_clients():
    before = set(_listening(os.getpid()))
    store = rendezvous_store("127.0.0.1", find_free_port(), 1, host=True, timeout=TIMEOUT)
    opened = set(_listening(os.getpid())) - before
    assert opened == {("127.0.0.1", store.port)}
    client = rendezvous_store("127.0.0.1", store.port, 1, host=False, timeout=TIMEOUT)
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_store_on_an_address_not_this_machines_is_refused_naming_it():
    with pytest.raises(LaunchError, match=rf"cannot listen on the rendezvous address {NOT_OURS}:\d+ .*MASTER_ADDR"):
        rendezvous_store(NOT_OURS, 29500, 2, host=True, timeout=TIMEOUT)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the loopback interface is named lo on Linux")
def test_gloo_is_pinned_to_the_interface_towards_the_rendezvous_unless_the_launch_chose(monkeypatch):
    monkeypatch.delenv(GLOO_IFNAME, raising=False)
    with gloo_interface("127.0.0.1"):
        assert os.environ[GLOO_IFNAME] == "lo"
    assert GLOO_IFNAME not in os.environ
    monkeypatch.setenv(GLOO_IFNAME, "eth7")
    with gloo_interface("127.0.0.1"):
        assert os.environ[GLOO_IFNAME] == "eth7"
    assert os.environ[GLOO_IFNAME] == "eth7"


def test_an_address_of_no_interface_is_refused():
    assert interface_of("127.0.0.1")
    with pytest.raises(LaunchError, match=f"no network interface of this machine has the address {NOT_OURS}"):
        interface_of(NOT_OURS)


def test_the_rendezvous_must_be_set_and_reachable_from_every_node():
    two_nodes = ParallelConfig(device="cpu", num_nodes=2, num_devices_per_node=1)
    one_node = ParallelConfig(device="cpu", num_devices_per_node=2)
    with pytest.raises(LaunchError, match="MASTER_PORT not set for a launch of 2 ranks"):
        rendezvous_from_env({"WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3"}, two_nodes)
    with pytest.raises(LaunchError, match="MASTER_ADDR=127.0.0.1 is a loopback address .* spans 2 nodes"):
        rendezvous_from_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, two_nodes)
    assert rendezvous_from_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, one_node) == ("127.0.0.1", 29500)
    assert rendezvous_from_env({"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}, two_nodes) == ("10.1.2.3", 29500)


def _group_member(rank: int, port: int, out_dir: str) -> None:
    os.environ.pop(GLOO_IFNAME, None)
    group = init_weight_update_group("127.0.0.1", port, rank, 2, "sockets", backend="gloo")
    value = torch.ones(2)
    torch.distributed.all_reduce(value, group=group)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"sum": value.tolist(), "listening": _listening(os.getpid())}, handle)
    torch.distributed.barrier(group=group)  # both listed before either tears down


def test_a_real_group_listens_on_the_loopback_address_only(tmp_path):
    port = find_free_port()
    mp.start_processes(_group_member, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["sum"] == [2.0, 2.0] for r in ranks)
    for r in ranks:
        assert r["listening"] and all(ip == "127.0.0.1" for ip, _ in r["listening"]), r["listening"]
    # Rank 0 hosts the store on the given port, besides its gloo listener; rank 1 has its own.
    assert ["127.0.0.1", port] in ranks[0]["listening"] and len(ranks[0]["listening"]) == 2
    assert len(ranks[1]["listening"]) == 1


def test_plan_says_what_a_run_listens_on_and_where(capsys):
    assert main(["plan", str(DEMO)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("network:")]
    assert line.startswith("network: listens on 127.0.0.1 only, never 0.0.0.0, on ports picked free at start: Ray")
    assert "the actor's rendezvous store (rank 0) and gloo's pair listeners" in line
    separate = network_plan(load_config(DEMO, ["rollout.colocate=false", "ray.address=10.0.0.1:6379"]))
    assert "listens on each node's address as Ray knows it" in separate and "127.0.0.1" not in separate
    assert "the weight-update group's store (rank 0) and a listener per engine rank" in separate
    recipe = network_plan(load_config(DEMO.parents[1] / "qwen2_5_32b/dapo.yaml", []))  # 16 nodes, no address yet
    assert "listens on each node's address as Ray knows it" in recipe and "127.0.0.1" not in recipe
    gpu = network_plan(load_config(DEMO, ["parallel.device=cuda", "parallel.use_distributed_optimizer=false"]))
    assert "gloo" not in gpu and gpu.endswith(
        "not pinned: NCCL's and SGLang's own listeners (on the interfaces they pick)"
    )
