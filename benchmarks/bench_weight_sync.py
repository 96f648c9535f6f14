"""Weight-sync throughput, actor -> transformers engine, against a plain memory copy.

Run: ``.venv/bin/python benchmarks/bench_weight_sync.py [--layers 16] [--processes]``.

``--processes`` measures the sync the trainer runs: the actor rank and each engine are
separate Ray actors (processes), buckets cross by shared-memory handle, with one engine
and with two fed in parallel. Without it:

One CPU rank holds a Megatron actor of about 1.1 GB (fp32; hidden 1024, 16 layers, ffn
4096, vocab 32000) and a transformers engine of the same shape in the same process;
:func:`sync_weights` streams the actor's weights into the engine in 512 MiB buckets
(gather, mapping to HF layout, bucketing, the engine's checks and adoption). The anchor is
``dst.copy_(src)`` of the same number of bytes on the same machine. Best of three each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _config(layers: int, **extra):
    from dapo_megatron.config import config_from_dict

    return config_from_dict(
        {
            "model": {
                "num_layers": layers,
                "hidden_size": 1024,
                "ffn_hidden_size": 4096,
                "num_attention_heads": 16,
                "num_query_groups": 4,
                "vocab_size": 32000,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1e6,
                "tie_word_embeddings": False,
            },
            "parallel": {"device": "cpu"},
            "rollout": {"max_prompt_length": 64, "max_response_length": 128},
            "algorithm": {"overlong_buffer_len": 32},
            "data": {"train_batch_size": 4, "mini_batch_size": 4},
            "trainer": {"micro_batch_max_tokens": 512},
            **extra,
        }
    )


def _plain_copy_seconds(num_bytes: int) -> float:
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - start)
    return min(copies)


def _rank(out_file: str, layers: int) -> None:
    from dapo_megatron.actor.megatron_actor import MegatronActor
    from dapo_megatron.actor.weight_sync import sync_weights
    from dapo_megatron.rollout.hf_engine import HFRolloutEngine
    from dapo_megatron.runtime.distributed import megatron_runtime

    cfg = _config(layers)
    with megatron_runtime(cfg.parallel, seed=0) as info:
        actor = MegatronActor(cfg.model, cfg.parallel, cfg.trainer, cfg.algorithm, info)
        engine = HFRolloutEngine.from_model_config(cfg.model)
        syncs = [sync_weights(actor, engine) for _ in range(3)]
        best = min(syncs, key=lambda s: s.seconds)
        copy_seconds = _plain_copy_seconds(best.num_bytes)
        Path(out_file).write_text(
            json.dumps(
                {
                    "bytes": best.num_bytes,
                    "sync_seconds": best.seconds,
                    "buckets": best.num_buckets,
                    "tensors": best.num_tensors,
                    "copy_seconds": copy_seconds,
                }
            )
        )


def across_processes(layers: int, num_engines: int, colocate: bool) -> dict:
    """Sync seconds (best of three) from an actor rank into ``num_engines`` engine processes:
    by shared-memory handle (``colocate``) or by gloo broadcast over a weight-update group."""
    from dapo_megatron.orchestration.actor_group import ActorGroup
    from dapo_megatron.orchestration.cluster import RayCluster
    from dapo_megatron.orchestration.rollout import RolloutWorkers

    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        cfg = _config(
            layers,
            rollout={
                "max_prompt_length": 64,
                "max_response_length": 128,
                "engine": "hf",
                "num_engines": num_engines,
                "colocate": colocate,
            },
        )
        with RayCluster(cfg.ray, work, num_cpus=4):
            actor, engines = ActorGroup(cfg), RolloutWorkers(cfg)
            try:
                syncs = [actor.sync_weights(engines.handles, 512 * 2**20) for _ in range(3)]
            finally:
                engines.shutdown()
                actor.shutdown()
    best = min(syncs, key=lambda s: s.seconds)
    return {"bytes": best.num_bytes, "sync_seconds": best.seconds, "engines": num_engines, "colocate": colocate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--processes", action="store_true", help="actor and engines in separate processes (Ray)")
    args = parser.parse_args()
    if args.processes:
        results = [across_processes(args.layers, n, colocate) for colocate in (True, False) for n in (1, 2)]
        copy_seconds = _plain_copy_seconds(results[0]["bytes"])
        print(
            f"weights: {results[0]['bytes'] / 1e9:.2f} GB; plain copy of the same bytes: {copy_seconds:.2f} s = "
            f"{results[0]['bytes'] / copy_seconds / 1e9:.2f} GB/s"
        )
        for r in results:
            print(
                f"sync into {r['engines']} engine process(es) "
                f"{'by shared-memory handle' if r['colocate'] else 'by gloo broadcast'}: {r['sync_seconds']:.2f} s "
                f"({r['sync_seconds'] / copy_seconds:.2f}x the plain copy's time)"
            )
        return
    from dapo_megatron.runtime.launch import launch_local

    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "result.json")
        launch_local(_rank, 1, (out, args.layers), env={"OMP_NUM_THREADS": "2"})
        r = json.loads(Path(out).read_text())
    sync_rate = r["bytes"] / r["sync_seconds"]
    copy_rate = r["bytes"] / r["copy_seconds"]
    print(f"weights: {r['bytes'] / 1e9:.2f} GB in {r['tensors']} tensors, {r['buckets']} buckets of <= 512 MiB")
    print(
        f"sync: {r['sync_seconds']:.2f} s = {sync_rate / 1e9:.2f} GB/s; plain copy: {r['copy_seconds']:.2f} s = "
        f"{copy_rate / 1e9:.2f} GB/s; ratio {sync_rate / copy_rate:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
