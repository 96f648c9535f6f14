"""A tiny model with the demo's tokenizer and task, shared by the end-to-end tests; what
they check a Ray instance's exposure with (its listening sockets, a client's access); and
the package's Ray head, which the runs that do not test Ray itself join (``shared_ray``)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Optional

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _demo_prepare():
    spec = importlib.util.spec_from_file_location("demo_prepare", REPO / "examples/demo/prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_task_with(root: Path, make_config) -> Path:
    """The demo's tokenizer and task in ``root``, and a random model of the config that
    ``make_config(vocab_size, eos_token_id)`` returns in ``root / "model"``."""
    from transformers import AutoModelForCausalLM

    prepare = _demo_prepare()
    tokenizer = prepare.build_tokenizer(root / "model")
    prepare.write_task(root / "data")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config(len(prepare.VOCAB), tokenizer.eos_token_id)).save_pretrained(
        root / "model"
    )
    return root


_TINY = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def tiny_qwen2_task(root: Path) -> Path:
    """A random tiny Qwen2 with the demo's tokenizer, and the demo's addition task, in ``root``."""
    from transformers import Qwen2Config

    return _demo_task_with(
        root,
        lambda vocab, eos: Qwen2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, eos_token_id=eos, **_TINY
        ),
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random tiny Qwen2 with the demo's tokenizer, and the demo's addition task."""
    return tiny_qwen2_task(tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """A random tiny Qwen3-MoE (2 layers of 4 experts, top 2) with the demo's tokenizer and task."""
    from transformers import Qwen3MoeConfig

    return _demo_task_with(
        tmp_path_factory.mktemp("e2e_moe"),
        lambda vocab, eos: Qwen3MoeConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            head_dim=16,
            eos_token_id=eos,
            **_TINY,
        ),
    )


def run_config(root: Path, out: Path, **overrides) -> dict:
    config = {
        "model": {"hf_config": str(root / "model"), "make_vocab_size_divisible_by": 8},
        "parallel": {"device": "cpu", "num_devices_per_node": 2, "tp_size": 2},
        "rollout": {
            "engine": "hf",
            "n_samples_per_prompt": 4,
            "temperature": 0.7,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "val_n_samples": 2,
            "val_top_p": 1.0,
        },
        "algorithm": {"overlong_buffer_len": 2, "reward_fn": "tests.e2e.rewards:mixed_for_even_answers"},
        "data": {
            "train_files": [str(root / "data/train.jsonl")],
            "val_files": [str(root / "data/val.jsonl")],
            "train_batch_size": 4,
            "gen_batch_size": 4,
            "mini_batch_size": 8,
        },
        "trainer": {
            "num_steps": 2,
            "lr": 1e-3,
            "lr_warmup_steps": 0,
            "micro_batch_max_tokens": 64,
            "output_dir": str(out),
        },
        "checkpoint": {"save_every": 2, "export_hf": False},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        config[section][key] = value
    return config


WILDCARD = {"0.0.0.0", "::", "*", ""}
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


class Listener(NamedTuple):
    pid: int
    name: str
    kind: str
    ip: str
    port: int


def listening_sockets(root: psutil.Process) -> list[Listener]:
    """Every socket that accepts traffic in ``root`` and all its descendants: TCP sockets
    in LISTEN and UDP sockets bound to a port but connected to no peer."""
    found = []
    for process in [root, *root.children(recursive=True)]:
        try:
            name, connections = process.name(), process.net_connections(kind="inet")
        except psutil.Error:  # ended meanwhile
            continue
        for c in connections:
            tcp = c.type == socket.SOCK_STREAM
            if (tcp and c.status == psutil.CONN_LISTEN) or (not tcp and c.laddr and c.laddr.port and not c.raddr):
                found.append(Listener(process.pid, name, "tcp" if tcp else "udp", c.laddr.ip, c.laddr.port))
    return found


CONNECT = "import ray; ray.init(address='{address}', logging_level='ERROR'); print('CONNECTED', ray.cluster_resources()['CPU'])"


def ray_client(address: str, token_file: Optional[Path] = None) -> subprocess.CompletedProcess:
    """A Ray driver in a process of its own on this machine (in Ray's single-machine mode,
    like the instances under test) connecting to ``address``: with the token in
    ``token_file``, or without any (``RAY_AUTH_MODE=disabled``). Prints ``CONNECTED <CPUs>``
    once in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if token_file is None:
        env["RAY_AUTH_MODE"] = "disabled"
        # Refused, Ray's client would retry its connection 20 times, a second apart (~20 s
        # a test); it gives up after 2 tries, with the same error.
        env["RAY_NUM_REDIS_GET_RETRIES"] = "2"
    else:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    command = [sys.executable, "-c", CONNECT.format(address=address)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


# Four steps with a checkpoint every two; no validation (it is not part of the state).
FOUR_STEPS = {
    "trainer.num_steps": 4,
    "checkpoint.save_every": 2,
    "trainer.val_before_train": False,
    "trainer.val_every": 0,
}
# One actor rank (tp 1, dp 1) for runs whose checks need no second rank: a run at tp 2
# has dp 1 too, so the batches, mini-batches and steps are the same, with one rank's
# start and no tensor-parallel collectives. (tp_size 1 alone would give dp 2: two ranks.)
ONE_RANK = {"parallel.tp_size": 1, "parallel.num_devices_per_node": 1}
# Wall-clock figures differ between any two runs; everything else must not.
TIMING_PREFIXES = ("time/", "throughput/", "sync/gb_per_s")


def step_metrics(run: Path) -> dict[int, dict[str, float]]:
    """Each step's metrics of ``run`` (``metrics.jsonl``), wall-clock figures left out."""
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {}
    for row in rows:
        step = row.pop("step")
        assert step not in steps, f"step {step} logged twice"
        steps[step] = {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}
    return steps


@pytest.fixture(scope="package")
def uninterrupted(tiny_model, tmp_path_factory, _shared_ray_head) -> tuple[Path, dict]:
    """:data:`FOUR_STEPS` of the tiny model without a stop, exported (one run, on the
    package's Ray head, which every test comparing with an uninterrupted run reads): the
    run folder, and the weights the engine served at the end."""
    from dapo_megatron.config import config_from_dict
    from dapo_megatron.run.trainer import train

    whole = tmp_path_factory.mktemp("whole") / "run"
    seen = {}
    with driver_of(_shared_ray_head) as address:
        raw = run_config(tiny_model, whole, **FOUR_STEPS, **{"checkpoint.export_hf": True})
        train(
            config_from_dict(joined(raw, address)),
            inspect=lambda actor, engines: seen.update(engine=engines.served_weights()),
        )
    return whole, seen


def assert_loopback_only(sockets: list, ranks: list[int], engines: list[int]) -> None:
    """Nothing of a run listens beyond the loopback address: ``sockets`` (every listener of
    the driver's process tree, from :func:`listening_sockets`, taken while the run is up)
    are all on 127.0.0.1 or ::1, and the listing reached the processes that matter: every
    rank (pids ``ranks``) has its gloo listeners, rank 0 the rendezvous store and, with
    separate engines, the weight-update group's store on top, every engine (``engines``)
    its listener in that group, and Ray's own daemons theirs."""
    wildcard = [s for s in sockets if s.ip in WILDCARD]
    assert not wildcard, f"listening on every interface: {wildcard}"
    assert all(s.ip in LOOPBACK for s in sockets), [s for s in sockets if s.ip not in LOOPBACK]
    per_pid = {pid: [s for s in sockets if s.pid == pid and s.kind == "tcp"] for pid in ranks + engines}
    assert all(per_pid.values()), per_pid
    rank0, *others = ranks
    assert len(per_pid[rank0]) >= 2 + max(len(per_pid[pid]) for pid in others), per_pid
    assert any(s.name.startswith(("gcs_server", "raylet")) for s in sockets), sockets


@pytest.fixture(scope="package")
def _shared_ray_head():
    """One :func:`tests.e2e.ray_head.ray_head` for the runs of this package that do not test
    Ray itself (see that module); the package's last test stops it."""
    from tests.e2e.ray_head import ray_head

    with ray_head() as head:
        yield head


@contextmanager
def driver_of(head: tuple[str, Path]) -> Iterator[str]:
    """Inside the block this process talks to the Ray head ``head`` (``(address, token
    file)``, :func:`tests.e2e.ray_head.ray_head`) as a driver of a private instance does:
    with its token, loopback only; the address, for a run to join (:func:`joined`).
    Afterwards this process's environment and Ray settings are as they were."""
    from dapo_megatron.orchestration.cluster import TOKEN_FILE, PrivateRay

    address, token = head
    assert token.name == TOKEN_FILE, token
    with PrivateRay(token.parent, join=True):
        yield address


@pytest.fixture
def shared_ray(_shared_ray_head):
    """The package's Ray head for the test's runs to join (:func:`joined`), see :func:`driver_of`."""
    with driver_of(_shared_ray_head) as address:
        yield address


def joined(raw: dict, address: str) -> dict:
    """``raw`` (a :func:`run_config`) joining the Ray cluster at ``address``."""
    raw.setdefault("ray", {})["address"] = address
    return raw
