"""The local Ray instance ``train`` starts listens on 127.0.0.1 only and refuses clients
without its token."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import psutil

from dapo_megatron.config import RayConfig
from dapo_megatron.orchestration.cluster import TOKEN_FILE, RayCluster

CONNECT = "import ray; ray.init(address='{address}', logging_level='ERROR'); print('CONNECTED', ray.cluster_resources()['CPU'])"


def test_a_client_without_the_token_is_refused(tmp_path):
    import ray

    # A client on this machine, in Ray's single-machine mode like the instance.
    outside = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    outside["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    before = {k: v for k, v in os.environ.items() if k.startswith(("RAY_AUTH", "RAY_ENABLE"))}
    with RayCluster(RayConfig(), tmp_path / "run", num_cpus=2) as cluster:
        address = ray.get_runtime_context().gcs_address
        token = cluster._token_file
        assert token.name == TOKEN_FILE and stat.S_IMODE(token.stat().st_mode) == 0o600
        assert ray.get(ray.remote(lambda: os.environ["RAY_AUTH_MODE"]).remote()) == "token"  # workers too
        # Every socket the instance's processes listen on is on the loopback address.
        listening = set()
        for process in psutil.Process().children(recursive=True):
            try:
                listening |= {c.laddr.ip for c in process.net_connections(kind="tcp") if c.status == "LISTEN"}
            except psutil.Error:
                continue
        assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening
        assert address.startswith("127.0.0.1:")

        def connect(env: dict) -> subprocess.CompletedProcess:
            command = [sys.executable, "-c", CONNECT.format(address=address)]
            return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

        refused = connect({**outside, "RAY_AUTH_MODE": "disabled"})
        assert refused.returncode != 0 and "CONNECTED" not in refused.stdout
        allowed = connect({**outside, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
        assert allowed.returncode == 0 and "CONNECTED 2.0" in allowed.stdout, allowed.stderr[-2000:]
    # Stopped: the secret is gone and this process's environment is as it was.
    assert not token.exists()
    assert {k: v for k, v in os.environ.items() if k.startswith(("RAY_AUTH", "RAY_ENABLE"))} == before
