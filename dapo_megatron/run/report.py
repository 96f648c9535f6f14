"""``dapo-megatron report RUN``: one self-contained HTML page of a run, finished or not.

The page reads what the run folder holds (``metrics.jsonl``, ``config.yaml``, the
rollout records; a half-written last line is skipped, so a run in progress works) and
needs nothing at view time: the plots are inline SVG, the style inline CSS, no script, no
network. It shows

- the learning curve: validation accuracy, the training batch's accuracy and reward;
- the response length and the policy's entropy;
- the train-inference mismatch (the K3 estimate of KL(engine || actor) and the log-prob gap);
- the phases of a step (generate, reward, old log-probs, train, sync, the whole step);
- dynamic sampling's keep rate (groups kept of those generated);
- for chosen steps (by default the first, middle and last recorded), the best, the worst
  and the most frequent responses, with their rewards (from the rollout records).
"""

from __future__ import annotations

import gzip
import html
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from dapo_megatron.run.metrics_log import validation_course
from dapo_megatron.run.rollout_records import RECORDS_DIR, record_step

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
"""The series' colors, in order (the browser test looks for the first in its screenshot)."""

CHARTS = (
    ("Learning curve", "accuracy / reward", ("val/accuracy", "reward/accuracy", "reward/score_mean")),
    ("Response length", "tokens", ("response/length_mean", "val/response_length_mean")),
    ("Entropy", "nats per token", ("actor/entropy",)),
    (
        "Train-inference mismatch",
        "per token",
        ("rollout_mismatch/kl_k3_mean", "rollout/logprob_diff_mean"),
    ),
    (
        "Phases of a step",
        "seconds",
        ("time/generate", "time/reward", "time/old_log_prob", "time/train", "time/sync", "time/step"),
    ),
    ("Dynamic sampling", "groups kept / generated", ("keep_rate",)),
)
"""The plots: title, y-axis label, the metrics drawn (``keep_rate`` is computed)."""


def read_metrics(run_dir: Path) -> list[dict]:
    """``metrics.jsonl``'s rows (a line being written is skipped)."""
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            generated = row.get("dynamic_sampling/generated")
            if generated:
                row["keep_rate"] = row.get("dynamic_sampling/kept", 0.0) / generated
            rows.append(row)
    return rows


def _series(rows: list[dict], name: str) -> list[tuple[float, float]]:
    return [
        (float(row["step"]), float(row[name]))
        for row in rows
        if isinstance(row.get(name), (int, float)) and math.isfinite(row[name])
    ]


def svg_chart(title: str, ylabel: str, series: dict[str, list[tuple[float, float]]]) -> str:
    """A line chart as inline SVG: each series a polyline (and a dot per point), axes
    with their ranges, a legend."""
    width, height, left, right, top, bottom = 560, 260, 56, 16, 28, 40
    points = [p for values in series.values() for p in values]
    if not points:
        return f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption><p>no data yet</p></figure>'
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def at(x: float, y: float) -> str:
        px = left + (x - x0) / (x1 - x0) * (width - left - right)
        py = top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
        f'<text x="{width / 2}" y="16" text-anchor="middle" class="title">{html.escape(title)}</text>',
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" class="axis"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" class="axis"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" class="tick">{y1:.4g}</text>',
        f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end" class="tick">{y0:.4g}</text>',
        f'<text x="{left}" y="{height - bottom + 14}" class="tick">{x0:g}</text>',
        f'<text x="{width - right}" y="{height - bottom + 14}" text-anchor="end" class="tick">{x1:g}</text>',
        f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle" class="tick">step</text>',
        f'<text x="12" y="{(top + height - bottom) / 2}" class="tick" '
        f'transform="rotate(-90 12 {(top + height - bottom) / 2})" text-anchor="middle">{html.escape(ylabel)}</text>',
    ]
    for index, (name, values) in enumerate(series.items()):
        color = COLORS[index % len(COLORS)]
        if len(values) > 1:
            path = " ".join(at(x, y) for x, y in values)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [
            f'<circle cx="{at(x, y).split(",")[0]}" cy="{at(x, y).split(",")[1]}" r="2.5" fill="{color}"/>'
            for x, y in values
        ]
        parts.append(
            f'<text x="{left + 8 + 170 * (index % 3)}" y="{top + 14 + 14 * (index // 3)}" fill="{color}" class="legend">'
            f"{html.escape(name)}</text>"
        )
    parts.append("</svg>")
    return '<figure class="chart">' + "".join(parts) + "</figure>"


def _records(run_dir: Path) -> dict[int, Path]:
    folder = run_dir / RECORDS_DIR
    found = {}
    for path in folder.glob("step_*.jsonl.gz") if folder.is_dir() else []:
        step = record_step(path)
        if step is not None:
            found[step] = path
    return dict(sorted(found.items()))


def _read_records(path: Path) -> list[dict]:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return [json.loads(line) for line in handle]
    except (OSError, EOFError, json.JSONDecodeError):
        return []  # being written: the next report has it


def _responses_section(step: int, rows: list[dict], shown: int = 3) -> str:
    if not rows:
        return ""
    by_reward = sorted(rows, key=lambda r: r.get("reward", 0.0))
    frequent = Counter(row["response"] for row in rows).most_common(shown)
    reward_of = {row["response"]: row.get("reward") for row in rows}

    def items(chosen: list[dict]) -> str:
        return "".join(
            f'<li><span class="reward">{row.get("reward", float("nan")):+.3f}</span> '
            f'<span class="prompt">{html.escape(str(row.get("prompt", "")))}</span> '
            f"<pre>{html.escape(str(row.get('response', '')))}</pre></li>"
            for row in chosen
        )

    common = "".join(
        f'<li><span class="reward">{reward_of[text]:+.3f}</span> x{count} <pre>{html.escape(text)}</pre></li>'
        for text, count in frequent
    )
    return (
        f"<section><h3>Step {step}: {len(rows)} responses recorded</h3>"
        f'<div class="columns"><div><h4>Best</h4><ol>{items(by_reward[::-1][:shown])}</ol></div>'
        f"<div><h4>Worst</h4><ol>{items(by_reward[:shown])}</ol></div>"
        f"<div><h4>Most frequent</h4><ol>{common}</ol></div></div></section>"
    )


def chosen_steps(recorded: list[int], wanted: Optional[list[int]]) -> list[int]:
    """The steps whose responses are shown: ``wanted`` among the recorded ones, else the
    first, the middle and the last recorded."""
    if wanted:
        return [step for step in wanted if step in recorded]
    if len(recorded) <= 3:
        return recorded
    return [recorded[0], recorded[len(recorded) // 2], recorded[-1]]


def render(run_dir: str | Path, steps: Optional[list[int]] = None) -> str:
    """The report of ``run_dir`` as one HTML page (see the module docstring)."""
    import yaml

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.exists() else {}
    num_steps = (config.get("trainer") or {}).get("num_steps")
    trained = max((row["step"] for row in rows if "reward/score_mean" in row), default=0)
    state = "finished" if (run_dir / "hf_final").exists() or (num_steps and trained >= num_steps) else "in progress"
    charts = "".join(
        svg_chart(title, ylabel, {name: _series(rows, name) for name in names if _series(rows, name)})
        for title, ylabel, names in CHARTS
    )
    records = _records(run_dir)
    responses = "".join(
        _responses_section(step, _read_records(records[step])) for step in chosen_steps(list(records), steps)
    )
    validations = [(row["step"], row["val/accuracy"]) for row in rows if "val/accuracy" in row]
    val_line = f"<p>Validation accuracy: {validation_course(validations)}.</p>" if validations else ""
    style = (
        "body{font-family:sans-serif;margin:24px;color:#222}"
        ".charts{display:flex;flex-wrap:wrap;gap:12px}.chart{margin:0;border:1px solid #ddd;padding:4px}"
        ".axis{stroke:#444}.tick{font-size:11px;fill:#444}.title{font-size:13px;font-weight:bold}"
        ".legend{font-size:11px}.columns{display:flex;gap:16px}.columns>div{flex:1;min-width:0}"
        "pre{white-space:pre-wrap;background:#f6f6f6;padding:4px;margin:2px 0;max-height:12em;overflow:auto}"
        ".reward{font-weight:bold}.prompt{color:#555}"
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>dapo-megatron run {html.escape(run_dir.name)}</title><style>{style}</style></head><body>"
        f"<h1>Run {html.escape(str(run_dir))}</h1>"
        f"<p>{trained} of {num_steps or '?'} steps trained ({state}); report written "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}.</p>{val_line}"
        f'<h2>Metrics</h2><div class="charts">{charts}</div>'
        f"<h2>Responses</h2>{responses or '<p>no rollout records (logging.rollout_records_every=0)</p>'}"
        "</body></html>\n"
    )


def write_report(run_dir: str | Path, out: Optional[str | Path] = None, steps: Optional[list[int]] = None) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``<run>/report.html``)."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a run folder, or the run has not logged a step)")
    path = Path(out) if out is not None else run_dir / "report.html"
    path.write_text(render(run_dir, steps), encoding="utf-8")
    return path
