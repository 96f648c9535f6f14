"""Draws docs/img/dapo_step.png: one DAPO step through this system, for the README.

A picture drawn from code (matplotlib, no data): what runs where in a step, in order, and
what each stage hands the next. Run: ``.venv/bin/python tools/draw_step.py``.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "img" / "dapo_step.png"

# (column, row, title, body, colour): the engines, the driver, the actor.
ENGINE, DRIVER, ACTOR = "#dbe9f6", "#fdf2d0", "#e3f1df"
BOXES = [
    (0, 0, "prompts", "gen_batch_size prompts\nfrom the data loader", DRIVER),
    (
        1,
        0,
        "generate",
        "n responses per prompt\nSGLang (GPU) / transformers (CPU)\nper-token sampling log-probs",
        ENGINE,
    ),
    (2, 0, "reward", "dapo_math score +1 / -1\n+ overlong penalty\nin reward worker processes", DRIVER),
    (
        3,
        0,
        "dynamic sampling",
        "keep groups with right and\nwrong answers; generate more\nuntil train_batch_size groups",
        DRIVER,
    ),
    (3, 1, "advantages", "per group: (r - mean) / std\nover its n responses", DRIVER),
    (
        2,
        1,
        "old log-probs",
        "the actor's, on the same\nmicro-batches as the updates\n(+ reference, TIS/MIS weights)",
        ACTOR,
    ),
    (
        1,
        1,
        "updates",
        "mini-batches; token-level loss,\nclip-higher (0.2 / 0.28), divided by\nthe global response-token count",
        ACTOR,
    ),
    (0, 1, "weight sync", "Megatron TP/PP shards -> HF names\nbuckets streamed into the engines", ACTOR),
]
ARROWS = [
    ((0, 0), (1, 0)),
    ((1, 0), (2, 0)),
    ((2, 0), (3, 0)),
    ((3, 0), (3, 1)),
    ((3, 1), (2, 1)),
    ((2, 1), (1, 1)),
    ((1, 1), (0, 1)),
    ((0, 1), (0, 0)),
]
WIDTH, HEIGHT, GAP_X, GAP_Y = 3.4, 1.5, 0.7, 0.9


def _centre(column: int, row: int) -> tuple[float, float]:
    return column * (WIDTH + GAP_X) + WIDTH / 2, -row * (HEIGHT + GAP_Y) - HEIGHT / 2


def draw(path: Path = OUTPUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    fig, ax = plt.subplots(figsize=(14, 5.2), dpi=110)
    for column, row, title, body, colour in BOXES:
        x, y = _centre(column, row)
        ax.add_patch(
            FancyBboxPatch(
                (x - WIDTH / 2, y - HEIGHT / 2),
                WIDTH,
                HEIGHT,
                boxstyle="round,pad=0.02,rounding_size=0.12",
                facecolor=colour,
                edgecolor="#555555",
                linewidth=1.2,
            )
        )
        ax.text(x, y + HEIGHT / 2 - 0.28, title, ha="center", va="center", fontsize=11.5, weight="bold")
        ax.text(x, y - 0.18, body, ha="center", va="center", fontsize=8.6, linespacing=1.35)
    for (c0, r0), (c1, r1) in ARROWS:
        (x0, y0), (x1, y1) = _centre(c0, r0), _centre(c1, r1)
        if r0 == r1:
            sign = 1 if x1 > x0 else -1
            start, end = (x0 + sign * WIDTH / 2, y0), (x1 - sign * WIDTH / 2, y1)
        else:
            sign = 1 if y1 > y0 else -1
            start, end = (x0, y0 + sign * HEIGHT / 2), (x1, y1 - sign * HEIGHT / 2)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=16, linewidth=1.4, color="#333333"))
    ax.text(
        _centre(0, 0)[0] - WIDTH / 2 - 0.15,
        (_centre(0, 0)[1] + _centre(0, 1)[1]) / 2,
        "next step",
        rotation=90,
        ha="right",
        va="center",
        fontsize=9,
        color="#333333",
    )
    ax.legend(
        handles=[
            Patch(facecolor=ENGINE, edgecolor="#555555", label="rollout engines"),
            Patch(facecolor=DRIVER, edgecolor="#555555", label="driver (Ray)"),
            Patch(facecolor=ACTOR, edgecolor="#555555", label="Megatron actor ranks"),
        ],
        loc="lower center",
        bbox_to_anchor=(0.5, -0.13),
        ncol=3,
        frameon=False,
        fontsize=9.5,
    )
    ax.set_title("One DAPO step in dapo_megatron", fontsize=13)
    ax.set_xlim(-0.6, 4 * WIDTH + 3 * GAP_X + 0.2)
    ax.set_ylim(-2 * HEIGHT - GAP_Y - 0.3, 0.35)
    ax.set_aspect("equal")
    ax.axis("off")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(f"wrote {draw().relative_to(ROOT)}")
