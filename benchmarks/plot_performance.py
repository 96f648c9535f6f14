"""The plots of ``docs/performance.md``, from a ``bench --json`` file and a run's metrics.

Run: ``.venv/bin/python benchmarks/plot_performance.py --bench BENCH.json
--metrics runs/demo/run-<time>/metrics.jsonl --out docs/img`` (needs the ``bench`` extra:
matplotlib). Writes

- ``step_breakdown.png``: one step's median seconds per phase and the share in no phase;
- ``demo_learning.png``: reward, training accuracy, validation accuracy and response
  length over the run's steps;
- ``demo_mismatch.png``: the reward beside the training-inference mismatch (K3 KL of the
  rollout policy from the actor's, mean and max per token; share of ratios outside the
  cap), when the run logged it.

With ``--async-metrics`` (a run with ``trainer.async_generation``) also
``demo_async_learning.png`` and ``demo_async_mismatch.png``, the same plots of that run.
With ``--bf16-metrics`` (a run with ``model.params_dtype=bfloat16``) also
``demo_bf16_mismatch.png``: that run's validation accuracy and mismatch (K3 KL per token,
the largest sequence log-ratio) beside the ``--metrics`` run's (fp32).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASE_LABELS = {
    "generate": "generate",
    "reward": "reward",
    "old_log_prob": "old log-prob",
    "train": "train",
    "sync": "weight sync",
    "outside_phases": "in no phase",
}


def plot_step_breakdown(bench: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = bench["phases"]["step"]
    names = list(PHASE_LABELS)
    seconds = [step["phases"][name]["seconds"] for name in names]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = 0.0
    for name, value in zip(names, seconds):
        ax.barh([0], [value], left=left, label=f"{PHASE_LABELS[name]} ({step['phases'][name]['share']:.1%})")
        left += value
    ax.set_yticks([])
    ax.set_xlabel("seconds (medians of the measured steps)")
    layout = bench["config"]["layout"]
    ax.set_title(
        f"One DAPO step: {layout['world_size']} actor ranks (tp {layout['tp_size']}, pp {layout['pp_size']}), "
        f"{layout['num_engines']} {layout['engine']} engine(s)",
        fontsize=9,
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    path = out / "step_breakdown.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_learning(metrics_file: Path, out: Path, name: str = "demo_learning.png") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "reward/score_mean" in r]
    val = [r for r in rows if "val/accuracy" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [r["step"] for r in train]
    left.plot(steps, [r["reward/score_mean"] for r in train], label="reward (kept groups)", lw=1)
    left.plot(steps, [r["reward/accuracy"] for r in train], label="training accuracy (kept groups)", lw=1)
    left.plot([r["step"] for r in val], [r["val/accuracy"] for r in val], "o-", label="validation accuracy (greedy)")
    left.set_xlabel("step")
    left.legend(fontsize=7)
    left.set_title("reward and accuracy", fontsize=9)
    right.plot(steps, [r["response/length_mean"] for r in train], lw=1)
    right.set_xlabel("step")
    right.set_title("mean response length (tokens)", fontsize=9)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_mismatch(metrics_file: Path, out: Path, name: str = "demo_mismatch.png") -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "rollout_mismatch/kl_k3_mean" in r]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.plot(steps, [r["reward/score_mean"] for r in rows], lw=1)
    left.set_xlabel("step")
    left.set_title("reward (kept groups)", fontsize=9)
    right.semilogy(steps, [max(r["rollout_mismatch/kl_k3_mean"], 1e-16) for r in rows], lw=1, label="K3 KL, mean")
    right.semilogy(steps, [max(r["rollout_mismatch/kl_k3_max"], 1e-16) for r in rows], lw=1, label="K3 KL, max")
    right.set_xlabel("step")
    right.set_title("KL(rollout || actor) per token", fontsize=9)
    right.legend(fontsize=7)
    outside = max(r["rollout_mismatch/ratio_outside_cap_share"] for r in rows)
    right.text(
        0.02, 0.02, f"largest share of ratios outside the cap: {outside:.2g}", transform=right.transAxes, fontsize=7
    )
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_precision_mismatch(fp32_file: Path, bf16_file: Path, out: Path, name: str = "demo_bf16_mismatch.png") -> Path:
    """Validation accuracy and the train-inference mismatch of a bf16 run beside an fp32 one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for label, file in (("fp32", fp32_file), ("bf16", bf16_file)):
        runs[label] = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    fig, (accuracy, kl, sequence) = plt.subplots(1, 3, figsize=(12, 3.2))
    for label, rows in runs.items():
        val = [r for r in rows if "val/accuracy" in r]
        accuracy.plot([r["step"] for r in val], [r["val/accuracy"] for r in val], "o-", label=label)
        mismatch = [r for r in rows if "rollout_mismatch/kl_k3_mean" in r]
        steps = [r["step"] for r in mismatch]
        kl.semilogy(
            steps, [max(r["rollout_mismatch/kl_k3_mean"], 1e-16) for r in mismatch], lw=1, label=f"{label} mean"
        )
        kl.semilogy(
            steps, [max(r["rollout_mismatch/kl_k3_max"], 1e-16) for r in mismatch], lw=1, ls="--", label=f"{label} max"
        )
        largest = [
            max(abs(r["rollout_mismatch/seq_log_ratio_max"]), abs(r["rollout_mismatch/seq_log_ratio_min"]), 1e-16)
            for r in mismatch
        ]
        sequence.semilogy(steps, largest, lw=1, label=label)
    accuracy.set_title("validation accuracy (greedy)", fontsize=9)
    kl.set_title("KL(rollout || actor) per token (K3)", fontsize=9)
    sequence.set_title("largest |sequence log-ratio| of a step", fontsize=9)
    for axis in (accuracy, kl, sequence):
        axis.set_xlabel("step")
        axis.legend(fontsize=7)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, required=True, help="a `dapo-megatron bench --json` file")
    parser.add_argument("--metrics", type=Path, required=True, help="a run's metrics.jsonl")
    parser.add_argument("--async-metrics", type=Path, help="metrics.jsonl of a run with async generation")
    parser.add_argument("--bf16-metrics", type=Path, help="metrics.jsonl of a run with model.params_dtype=bfloat16")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_step_breakdown(json.loads(args.bench.read_text()), args.out),
        plot_learning(args.metrics, args.out),
        plot_mismatch(args.metrics, args.out),
    ]
    if args.async_metrics is not None:
        written += [
            plot_learning(args.async_metrics, args.out, "demo_async_learning.png"),
            plot_mismatch(args.async_metrics, args.out, "demo_async_mismatch.png"),
        ]
    if args.bf16_metrics is not None:
        written.append(plot_precision_mismatch(args.metrics, args.bf16_metrics, args.out))
    for path in written:
        if path is not None:
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
