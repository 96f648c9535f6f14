"""The evidence behind the asynchronous demo: seeds x rollout corrections x warm-up.

Runs the demo (``examples/demo/demo.yaml``) once per seed for each setting: one-step-off-
policy generation (``trainer.async_generation=true``) with no correction, token TIS and
token MIS, each with and without a learning-rate warm-up, and the synchronous control
(the sync happens before the next batch is generated: nothing is stale). Every run goes
through the real CLI, in its own folder; the table gives each setting's validation
accuracy before and after (min-max over seeds), the largest ``actor/approx_kl`` of any
step, the steps whose updates were all-clipped or skipped, and wall time.

    .venv/bin/python examples/demo/prepare.py runs/demo
    .venv/bin/python benchmarks/async_seeds.py --out runs/async_seeds

Prints a Markdown table and writes ``summary.json`` next to the runs. About 1.5 minutes a
run on 2 cores; the full matrix is 21 runs. ``--only`` picks settings by name.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEEDS = {"s0": {}, "s1": {"rollout.seed": 1, "data.seed": 1}, "s2": {"rollout.seed": 2, "data.seed": 2}}
WARMUP_STEPS = 5
SETTINGS = {
    "sync": {"trainer.async_generation": False},
    **{
        f"async-{correction}{'-warmup' if warmup else ''}": {
            "trainer.async_generation": True,
            "algorithm.rollout_correction": correction,
            "trainer.lr_warmup_steps": WARMUP_STEPS if warmup else 0,
        }
        for correction in ("none", "tis", "mis")
        for warmup in (False, True)
    },
}


def run_one(out: Path, overrides: dict) -> dict:
    args = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]
    command = [str(REPO / ".venv/bin/dapo-megatron"), "train", str(REPO / "examples/demo/demo.yaml")]
    command += [*args, f"trainer.output_dir={out}"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if out.exists() else []
    steps = [r for r in rows if "actor/approx_kl" in r]
    validations = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    return {
        "returncode": done.returncode,
        "error": done.stderr[-600:] if done.returncode else "",
        "seconds": seconds,
        "steps": len(steps),
        "val": validations,
        "approx_kl_max": max((r["actor/approx_kl"] for r in steps), default=float("nan")),
        "approx_kl_max_step": max(steps, key=lambda r: r["actor/approx_kl"])["step"] if steps else None,
        "ratio_max": max((r["actor/ratio_max"] for r in steps), default=float("nan")),
        "skipped_updates": sum(r.get("actor/updates_skipped", 0.0) for r in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs/async_seeds")
    parser.add_argument("--only", nargs="*", help="settings to run (default: all)")
    parser.add_argument("--retry-failed", action="store_true", help="run again the runs that failed before")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary_file = args.out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    for name, setting in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        for seed, seed_overrides in SEEDS.items():
            key = f"{name}/{seed}"
            if key in summary and (summary[key]["returncode"] == 0 or not args.retry_failed):
                continue  # done in an earlier invocation (a failed run is deterministic too)
            result = run_one(args.out / name / seed, {**setting, **seed_overrides})
            summary[key] = result
            summary_file.write_text(json.dumps(summary, indent=1))
            print(
                key, json.dumps({k: result[k] for k in ("returncode", "seconds", "val", "approx_kl_max")}), flush=True
            )
    print(table(summary))


def table(summary: dict) -> str:
    """The Markdown table: per setting, the final validation accuracy of each seed (at the
    config's last step; a run that stopped early says after which step), the first
    validation step at 90% or more, the largest approx_kl and the wall time per run."""
    import yaml

    last = yaml.safe_load((REPO / "examples/demo/demo.yaml").read_text())["trainer"]["num_steps"]
    lines = [
        f"| setting | val. accuracy after {last} steps (per seed) | first validation at >= 90% (per seed) "
        "| largest approx_kl (step) | seconds per run |",
        "|---|---|---|---|---|",
    ]
    for name in SETTINGS:
        runs = [summary[f"{name}/{s}"] for s in SEEDS if f"{name}/{s}" in summary]
        if not runs:
            continue
        finals = [r["val"].get(str(last), r["val"].get(last)) for r in runs]
        shown = [
            f"{100 * f:.0f}%" if f is not None else f"stopped after step {r['steps']} (dynamic sampling or error)"
            for f, r in zip(finals, runs)
        ]
        firsts = [min((int(k) for k, v in r["val"].items() if v >= 0.9), default=None) for r in runs]
        kl = max(runs, key=lambda r: r["approx_kl_max"])
        seconds = [r["seconds"] for r in runs]
        lines.append(
            f"| {name} | {', '.join(shown)} | {', '.join('-' if f is None else str(f) for f in firsts)} | "
            f"{kl['approx_kl_max']:.3g} ({kl['approx_kl_max_step']}) | {min(seconds):.0f}-{max(seconds):.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
