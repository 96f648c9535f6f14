"""The evidence behind rollout routing replay: the MoE demo in bf16, replay off and on.

Runs the mixture-of-experts demo (``examples/demo/demo_moe.yaml``: a tiny Qwen3-MoE,
experts over two ranks) with ``model.params_dtype=bfloat16``, where the engine
(transformers' kernels) and the actor (megatron's, router in fp32) route some tokens to
different experts, once per seed with ``model.routing_replay=measure`` (each routes on
its own; the actor counts the tokens it routes elsewhere) and once with ``rollout`` (the
actor replays the engine's experts). Both settings of a seed sample the same first
step; they diverge after it as their updates differ. Each run goes through the real CLI
in its own folder; the table gives, per setting, the engine-actor K3 mismatch and the
share of tokens routed elsewhere (means over steps, min-max over seeds) and the final
greedy accuracy, and ``--plot`` draws both per step.

    .venv/bin/python examples/demo/prepare.py runs/demo_moe --model-config examples/demo/model_config_moe.json
    .venv/bin/python benchmarks/routing_replay.py --out runs/routing_replay --plot docs/img/routing_replay.png

Writes ``summary.json`` (every run's per-step figures) next to the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEEDS = {"s0": {}, "s1": {"rollout.seed": 1, "data.seed": 1}, "s2": {"rollout.seed": 2, "data.seed": 2}}
SETTINGS = {"off": {"model.routing_replay": "measure"}, "replay": {"model.routing_replay": "rollout"}}
FIGURES = ("rollout_mismatch/kl_k3_mean", "rollout_mismatch/kl_k3_max", "moe/routing_changed_engine")


def run_one(out: Path, overrides: dict, steps: int) -> dict:
    args = [f"{k}={v}" for k, v in overrides.items()]
    command = [str(REPO / ".venv/bin/dapo-megatron"), "train", str(REPO / "examples/demo/demo_moe.yaml")]
    command += [*args, "model.params_dtype=bfloat16", f"trainer.num_steps={steps}", f"trainer.output_dir={out}"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if out.exists() else []
    steps_logged = [r for r in rows if "moe/routing_changed_engine" in r]
    return {
        "returncode": done.returncode,
        "error": done.stderr[-600:] if done.returncode else "",
        "seconds": seconds,
        "steps": {
            r["step"]: {name: r[name] for name in FIGURES + ("moe/replayed_share",) if name in r} for r in steps_logged
        },
        "val": {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r},
    }


def summarise(runs: dict) -> list[str]:
    lines = [
        "| routing | K3 mean (mean over steps) | K3 max (largest step) | tokens routed elsewhere | replayed | final greedy accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        mine = [run for (s, _), run in runs.items() if s == setting and not run["returncode"]]
        if not mine:
            continue

        def spread(values, fmt):
            return f"{fmt.format(min(values))} - {fmt.format(max(values))}"

        k3 = [statistics.mean(step["rollout_mismatch/kl_k3_mean"] for step in run["steps"].values()) for run in mine]
        k3_max = [max(step["rollout_mismatch/kl_k3_max"] for step in run["steps"].values()) for run in mine]
        changed = [
            statistics.mean(step["moe/routing_changed_engine"] for step in run["steps"].values()) for run in mine
        ]
        replayed = [
            statistics.mean(step.get("moe/replayed_share", 0.0) for step in run["steps"].values()) for run in mine
        ]
        final = [run["val"][max(run["val"], key=int)] for run in mine]
        lines.append(
            f"| {setting} | {spread(k3, '{:.2e}')} | {spread(k3_max, '{:.2e}')} | {spread(changed, '{:.2%}')} | "
            f"{spread(replayed, '{:.1%}')} | {spread(final, '{:.0%}')} |"
        )
    return lines


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("rollout_mismatch/kl_k3_mean", "K3 per token, mean over the step", True),
        ("rollout_mismatch/kl_k3_max", "K3 per token, largest of the step", True),
        ("moe/routing_changed_engine", "positions the actor routes elsewhere", False),
    )
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.9))
    colours = {"off": "#c0392b", "replay": "#2471a3"}
    for (setting, seed), run in sorted(runs.items()):
        if run["returncode"]:
            continue
        steps = sorted(run["steps"], key=int)
        for axis, (name, _, _) in zip(axes, panels):
            values = [run["steps"][s][name] for s in steps]
            axis.plot([int(s) for s in steps], values, color=colours[setting], alpha=0.8, label=f"{setting} ({seed})")
    for axis, (_, label, log) in zip(axes, panels):
        axis.set(xlabel="step", title=label, yscale="log" if log else "linear")
    axes[0].legend(fontsize=7)
    fig.suptitle("MoE demo, bf16, engine vs actor: routing replay off (measure) and on (rollout); 3 seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs/routing_replay")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", nargs="*", default=list(SEEDS))
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--summary", type=Path, help="table and plot of an earlier summary.json (no runs)")
    args = parser.parse_args()
    if args.summary is not None:
        saved = json.loads(args.summary.read_text())
        runs = {tuple(key.split("-", 1)): run for key, run in saved.items()}
        print("\n".join(summarise(runs)))
        if args.plot:
            plot(runs, args.plot)
        return
    runs = {}
    for seed in args.seeds:
        for setting, overrides in SETTINGS.items():
            out = args.out / f"{setting}-{seed}"
            if out.exists():
                raise SystemExit(f"{out} exists: pick another --out (a run folder is never reused)")
            runs[(setting, seed)] = run_one(out, {**SEEDS[seed], **overrides}, args.steps)
            run = runs[(setting, seed)]
            print(f"{setting} {seed}: rc={run['returncode']} {run['seconds']:.0f} s {run['error']}", flush=True)
    (args.out / "summary.json").write_text(
        json.dumps({f"{s}-{seed}": run for (s, seed), run in runs.items()}, indent=1)
    )
    print("\n".join(summarise(runs)))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
