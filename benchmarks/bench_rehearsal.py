"""How long `plan --rehearse` takes at full size, next to what Ray alone needs for the
same number of processes on the same machine.

A rehearsal starts one raylet per simulated node and one Ray worker process per stand-in
rank and engine: on a small machine its time is bounded below by Ray's own cost of
starting that many processes, whatever the rehearsal does. This benchmark measures, in
one run: **Ray alone** (the rehearsal's own simulated cluster, then as many empty actors
as the layout has stand-ins, spread over the nodes; nothing of this package runs in
them), then the rehearsal of each layout, with the machine's busy CPU seconds for each.

    .venv/bin/python benchmarks/bench_rehearsal.py --out docs/measured/rehearsal_<machine>.json

Layouts: ``recipe`` (examples/qwen2_5_32b/dapo.yaml: 16 nodes x 8 GPUs, tp 8 x pp 2 x
dp 8, 32 colocated engines of TP 4), ``engines-tp8`` (the same with 16 engines of TP 8),
``separate`` (32 separate engines of TP 4 on 16 spare nodes). ``--only`` picks some.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import ray

from dapo_megatron.config import load_config
from dapo_megatron.orchestration.rehearsal import declared_cluster, rehearse, spare_nodes_needed

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "qwen2_5_32b" / "dapo.yaml"
LAYOUTS = {
    "recipe": [],
    "engines-tp8": ["rollout.num_engines=16", "rollout.engine_tp_size=8"],
    "separate": ["rollout.colocate=false"],
}


def busy_cpu_seconds() -> float:
    """CPU seconds this machine has spent busy (all cores, all processes) since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def ray_alone(num_nodes: int, gpus_per_node: int, actors: int) -> dict:
    """The simulated cluster and ``actors`` empty actors, one per node in turn."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class Empty:
        def ready(self) -> bool:
            return True

    start, cpu = time.perf_counter(), busy_cpu_seconds()
    with declared_cluster(num_nodes, gpus_per_node, 32):
        up = time.perf_counter()
        nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        empties = [
            Empty.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False)
            ).remote()
            for i in range(actors)
        ]
        ray.get([empty.ready.remote() for empty in empties])
        placed = time.perf_counter()
    return {
        "cluster_start_s": round(up - start, 1),
        "actors_s": round(placed - up, 1),
        "total_s": round(time.perf_counter() - start, 1),
        "busy_cpu_s": round(busy_cpu_seconds() - cpu, 1),
    }


def rehearsal(overrides: list[str]) -> dict:
    config = load_config(RECIPE, overrides)
    start, cpu = time.perf_counter(), busy_cpu_seconds()
    result = rehearse(config, schedule_timeout_s=900)
    return {
        "overrides": overrides,
        "nodes": config.parallel.num_nodes + spare_nodes_needed(config),
        "stand_ins": len(result.ranks) + len(result.engines),
        "placing_s": round(result.seconds, 1),
        "total_s": round(time.perf_counter() - start, 1),
        "busy_cpu_s": round(busy_cpu_seconds() - cpu, 1),
        "problems": result.problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--only", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()
    recipe = load_config(RECIPE)
    members = recipe.parallel.world_size + recipe.rollout.num_engines
    results = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/bench_rehearsal.py --only " + " ".join(args.only),
        "ray_alone": {
            "nodes": recipe.parallel.num_nodes,
            "actors": members,
            **ray_alone(recipe.parallel.num_nodes, recipe.parallel.num_devices_per_node, members),
        },
    }
    print(
        f"Ray alone, {recipe.parallel.num_nodes} nodes and {members} empty actors: {results['ray_alone']}", flush=True
    )
    for name in args.only:
        results[name] = rehearsal(LAYOUTS[name])
        print(f"{name}: {results[name]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
