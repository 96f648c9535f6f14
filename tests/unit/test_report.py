"""``dapo-megatron report``: one self-contained page of a run (in progress too), its plots
inline SVG, the chosen steps' best, worst and most frequent responses; and, where
Chromium is installed, the page loaded in a real headless browser: no console error, and
the plots' pixels in the screenshot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from dapo_megatron.cli import main
from dapo_megatron.run.report import COLORS, render
from dapo_megatron.run.rollout_records import record_path, write_rows


def _run_folder(root, steps: int = 6):
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  num_steps: 10\n")
    lines = []
    for step in range(1, steps + 1):
        lines.append(
            {
                "step": step,
                "reward/score_mean": -1 + 0.3 * step,
                "reward/accuracy": 0.1 * step,
                "response/length_mean": 10.0 + step,
                "actor/entropy": 1.0 / step,
                "rollout_mismatch/kl_k3_mean": 1e-4 * step,
                "time/generate": 1.0,
                "time/train": 2.0,
                "time/step": 3.5,
                "dynamic_sampling/kept": 4.0,
                "dynamic_sampling/generated": 4.0 + step,
            }
        )
        if step % 3 == 0:
            lines.append({"step": step, "val/accuracy": 0.1 * step})
        rows = [
            {"step": step, "prompt": "1+1=", "response": f"Answer: {answer}", "reward": 1.0 if answer == 2 else -1.0}
            for answer in (2, 2, 2, 3, 7)
        ]
        write_rows(record_path(run, step), rows)
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 7, "reward/sc'  # a line being written
    (run / "metrics.jsonl").write_text(text)
    return run


def test_the_page_plots_every_series_and_shows_the_chosen_steps_responses(tmp_path, capsys):
    run = _run_folder(tmp_path)
    page = render(run)
    assert "6 of 10 steps trained (in progress)" in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert page.count("<svg") == 6
    points = [len(m.split()) for m in re.findall(r'<polyline points="([^"]+)"', page)]
    assert points.count(6) >= 8 and 2 in points  # six steps per series; two validations
    assert "Validation accuracy: first 30.0% (step 3), best 60.0% (step 6), last 60.0% (step 6)" in page
    assert re.findall(r"Step (\d+): 5 responses recorded", page) == ["1", "4", "6"]  # first, middle, last
    best, worst, frequent = re.findall(r"<h4>(\w+(?: \w+)?)</h4><ol>(.*?)</ol>", page)[:3]
    assert "+1.000" in best[1] and "Answer: 2" in best[1] and "-1.000" in worst[1] and "x3" in frequent[1]
    assert main(["report", str(run), "--steps", "2", "--out", str(tmp_path / "r.html")]) == 0
    assert re.findall(r"Step (\d+):", (tmp_path / "r.html").read_text()) == ["2"]
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl (not a run folder" in capsys.readouterr().err


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here (make test installs it where apt-get can)")
def test_the_page_loads_in_a_headless_browser_without_errors_and_shows_its_plots(tmp_path):
    from PIL import Image

    run = _run_folder(tmp_path)
    page = tmp_path / "report.html"
    page.write_text(render(run))
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,1600",
            f"--screenshot={shot}",
            "--enable-logging=stderr",
            "--v=0",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    image = Image.open(shot).convert("RGB")
    first = tuple(int(COLORS[0][i : i + 2], 16) for i in (1, 3, 5))
    pixels = image.getdata()
    drawn = sum(1 for pixel in pixels if pixel == first)
    assert drawn > 500, f"only {drawn} pixels of the first series' color: the plots did not render"
    # The charts fill the page's upper half in two columns: each column has lines.
    width, height = image.size
    left = sum(1 for y in range(height // 2) for x in range(width // 3) if image.getpixel((x, y)) == first)
    right = sum(
        1 for y in range(height // 2) for x in range(width // 3, 2 * width // 3) if image.getpixel((x, y)) == first
    )
    assert left > 100 and right > 100, (left, right)
