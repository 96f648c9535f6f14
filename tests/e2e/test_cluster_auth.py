"""The local Ray instance ``train`` starts listens on 127.0.0.1 only and refuses clients
without its token, and nothing a run opens listens on the wildcard address: a socket on
0.0.0.0 or :: is reachable from every network the machine is on, and neither Ray's
processes with auth on nor torch's rendezvous store (which has no authentication) should
be. Sockets are listed per process of the whole tree (the driver and every descendant:
Ray's daemons, workers, actor ranks, engines), TCP and UDP alike, so a listener nobody
thought of is caught too.
"""

from __future__ import annotations

import os
import stat

import psutil
import pytest

from dapo_megatron.config import RayConfig, config_from_dict
from dapo_megatron.orchestration.cluster import TOKEN_FILE, RayCluster
from dapo_megatron.trainer import train
from tests.e2e.conftest import LOOPBACK, WILDCARD, listening_sockets, ray_client, run_config


def test_a_client_without_the_token_is_refused(tmp_path):
    import ray

    before = {k: v for k, v in os.environ.items() if k.startswith(("RAY_AUTH", "RAY_ENABLE"))}
    with RayCluster(RayConfig(), tmp_path / "run", num_cpus=2) as cluster:
        address = ray.get_runtime_context().gcs_address
        token = cluster._token_file
        assert token.name == TOKEN_FILE and stat.S_IMODE(token.stat().st_mode) == 0o600
        assert ray.get(ray.remote(lambda: os.environ["RAY_AUTH_MODE"]).remote()) == "token"  # workers too
        # Every socket this process and the instance's processes listen on is on the loopback address.
        listening = listening_sockets(psutil.Process())
        assert listening and all(s.ip in LOOPBACK for s in listening), listening
        assert address.startswith("127.0.0.1:")
        # A client on this machine, in Ray's single-machine mode like the instance.
        refused = ray_client(address)
        assert refused.returncode != 0 and "CONNECTED" not in refused.stdout
        allowed = ray_client(address, token)
        assert allowed.returncode == 0 and "CONNECTED 2.0" in allowed.stdout, allowed.stderr[-2000:]
    # Stopped: the secret is gone and this process's environment is as it was.
    assert not token.exists()
    assert {k: v for k, v in os.environ.items() if k.startswith(("RAY_AUTH", "RAY_ENABLE"))} == before


@pytest.mark.timeout(600)
def test_nothing_a_run_opens_listens_beyond_the_loopback_address(tiny_model, tmp_path):
    """A whole run with separate engines: Ray, the actor ranks' rendezvous store and gloo
    listeners, the weight-update group's store and its members' gloo listeners."""
    raw = run_config(tiny_model, tmp_path / "run", **{"rollout.colocate": False, "trainer.num_steps": 1})
    raw["trainer"]["val_before_train"] = False
    raw["checkpoint"]["save_every"] = 0
    seen = {}

    def inspect(actor, engines):
        seen["sockets"] = listening_sockets(psutil.Process())
        seen["ranks"] = [info["pid"] for info in actor.infos]
        seen["engines"] = [health["pid"] for health in engines.health()]

    train(config_from_dict(raw, "sockets"), inspect=inspect)
    sockets = seen["sockets"]
    wildcard = [s for s in sockets if s.ip in WILDCARD]
    assert not wildcard, f"listening on every interface: {wildcard}"
    assert all(s.ip in LOOPBACK for s in sockets), [s for s in sockets if s.ip not in LOOPBACK]
    # The listing reached the processes that matter: every rank has its gloo listeners,
    # rank 0 the rendezvous store and the weight-update group's store on top, and every
    # engine its listener in the weight-update group; Ray's own daemons listen too.
    per_pid = {pid: [s for s in sockets if s.pid == pid and s.kind == "tcp"] for pid in seen["ranks"] + seen["engines"]}
    assert all(per_pid.values()), per_pid
    rank0, *others = seen["ranks"]
    assert len(per_pid[rank0]) >= 2 + max(len(per_pid[pid]) for pid in others), per_pid
    assert any(s.name.startswith(("gcs_server", "raylet")) for s in sockets), sockets
