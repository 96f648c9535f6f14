"""Every relative link of the repository's markdown reaches a file, and every anchor a
heading: the README is a front page whose details live under docs/, so a link that
breaks leaves a reader at a dead end."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _markdown_files() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "examples").rglob("*.md")),
        *sorted((ROOT / "tools").rglob("*.md")),
    ]


def _outside_code(path: Path):
    """``(line number, line)`` of ``path`` outside fenced code blocks."""
    inside = False
    for number, line in enumerate(path.read_text().split("\n"), 1):
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            yield number, line


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives ``path``'s headings: lower case, punctuation dropped,
    spaces as hyphens, a repeated heading numbered from -1."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _outside_code(path):
        match = HEADING.match(line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(2).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            found.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
    return found


def link_problems(paths: list[Path]) -> tuple[int, list[str]]:
    """How many relative links ``paths`` hold, and those that lead nowhere."""
    problems, checked = [], 0
    for path in paths:
        for number, line in _outside_code(path):
            for match in LINK.finditer(line):
                target = match.group(2)
                if re.match(r"^[a-z]+:", target):
                    continue
                checked += 1
                file_part, _, anchor = target.partition("#")
                destination = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.name}:{number}: {target}"
                if not destination.exists():
                    problems.append(f"{where}: no such file")
                elif anchor and (destination.suffix != ".md" or anchor not in _anchors(destination)):
                    problems.append(f"{where}: no heading with that anchor")
    return checked, problems


def test_every_relative_link_and_anchor_resolves():
    checked, problems = link_problems(_markdown_files())
    assert checked > 100  # the check sees the links (README and docs hold ~160)
    assert problems == []


def test_a_broken_link_is_seen(tmp_path):
    """The check above can fail: a missing file and a missing anchor are seen, a good
    anchor (of a repeated heading too) is not."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Step\n\n## Step\n\n[a](missing.md) [b](#no-such-heading) [c](#title) [d](#step-1)\n")
    checked, problems = link_problems([page])
    assert checked == 4
    assert problems == [
        "page.md:7: missing.md: no such file",
        "page.md:7: #no-such-heading: no heading with that anchor",
    ]
