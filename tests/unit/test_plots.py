"""The performance page's plots are written from a bench JSON and a run's metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_plot_script_writes_both_figures(tmp_path):
    phases = {
        name: {"seconds": s, "share": s / 1.0}
        for name, s in (
            ("generate", 0.4),
            ("reward", 0.05),
            ("old_log_prob", 0.1),
            ("train", 0.3),
            ("sync", 0.1),
            ("outside_phases", 0.05),
        )
    }
    bench = {
        "phases": {"step": {"phases": phases}},
        "config": {"layout": {"world_size": 2, "tp_size": 1, "pp_size": 1, "num_engines": 1, "engine": "hf"}},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    rows = [{"step": 0, "val/accuracy": 0.03}]
    rows += [
        {
            "step": s,
            "reward/score_mean": -1 + s / 5,
            "reward/accuracy": s / 10,
            "response/length_mean": 3.0,
            "rollout_mismatch/kl_k3_mean": 1e-7 * s,
            "rollout_mismatch/kl_k3_max": 1e-5 * s,
            "rollout_mismatch/ratio_outside_cap_share": 0.0,
            "rollout_mismatch/seq_log_ratio_max": 1e-5 * s,
            "rollout_mismatch/seq_log_ratio_min": -2e-5 * s,
        }
        for s in range(1, 6)
    ]
    rows.append({"step": 5, "val/accuracy": 0.3})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/plot_performance.py"),
            "--bench",
            str(tmp_path / "bench.json"),
            "--metrics",
            str(tmp_path / "metrics.jsonl"),
            "--async-metrics",
            str(tmp_path / "metrics.jsonl"),
            "--bf16-metrics",
            str(tmp_path / "metrics.jsonl"),
            "--out",
            str(tmp_path / "img"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    names = ("step_breakdown.png", "demo_learning.png", "demo_mismatch.png")
    for name in (*names, "demo_async_learning.png", "demo_async_mismatch.png", "demo_bf16_mismatch.png"):
        data = (tmp_path / "img" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
