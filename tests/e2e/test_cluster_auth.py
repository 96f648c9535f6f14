"""The local Ray instance ``train`` starts listens on 127.0.0.1 only and refuses clients
without its token, and nothing a run opens listens on the wildcard address: a socket on
0.0.0.0 or :: is reachable from every network the machine is on, and neither Ray's
processes with auth on nor torch's rendezvous store (which has no authentication) should
be. Sockets are listed per process of the whole tree (the driver and every descendant:
Ray's daemons, workers, actor ranks, engines), TCP and UDP alike, so a listener nobody
thought of is caught too: a whole run's, with separate engines, in
``tests/e2e/test_train.py`` (its broadcast run, by :func:`conftest.assert_loopback_only`).
"""

from __future__ import annotations

import os
import stat

import psutil

from dapo_megatron.config import RayConfig
from dapo_megatron.orchestration.cluster import TOKEN_FILE, RayCluster
from tests.e2e.conftest import LOOPBACK, listening_sockets, ray_client


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
        assert "Authentication token is missing or incorrect" in refused.stderr, refused.stderr[-2000:]
        allowed = ray_client(address, token)
        assert allowed.returncode == 0 and "CONNECTED 2.0" in allowed.stdout, allowed.stderr[-2000:]
    # Stopped: the secret is gone and this process's environment is as it was.
    assert not token.exists()
    assert {k: v for k, v in os.environ.items() if k.startswith(("RAY_AUTH", "RAY_ENABLE"))} == before
