"""The house drawn from its imports: every import of the package's own modules (those
inside functions too, which run as surely as the others, only later), read from the
source. The run's data must not climb back up: ``trainer`` is imported by the command
line alone, and no module reaches, directly or around a circle, back to itself."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dapo_megatron"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` (module ``name``) imports, anywhere in it."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` imports the module; ``from module import name`` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges without the ones from a package's ``__init__`` to its own submodules (a
    package re-exporting its modules is their front door, not a climb back up)."""
    return {
        name: {t for t in targets if not t.startswith(name + ".") or not _is_package(name)}
        for name, targets in graph.items()
    }


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def test_only_the_command_line_imports_the_trainer():
    graph = import_graph()
    importers = sorted(name for name, targets in graph.items() if "dapo_megatron.run.trainer" in targets)
    assert importers == ["dapo_megatron.cli"]
    # Where the trainer's helpers went: evaluation with evaluation, the initial weights
    # with the system's start, the export with the checkpoint code.
    assert "dapo_megatron.run.step" in graph["dapo_megatron.bench.run"]
    assert "dapo_megatron.ckpt.convert" in graph["dapo_megatron.run.evaluation"]


def test_no_module_imports_itself_around_a_circle():
    assert _cycles(_package_edges(import_graph())) == []


def test_the_cycle_finder_sees_a_circle():
    """Negative control: the circles this test was written against, put back."""
    graph = _package_edges(import_graph())
    graph["dapo_megatron.algo.rewards.dapo_math"].add("dapo_megatron.algo.rewards.registry")
    graph["dapo_megatron.ckpt.loading"].add("dapo_megatron.ckpt.convert")
    assert sorted(map(tuple, _cycles(graph))) == [
        ("dapo_megatron.algo.rewards.dapo_math", "dapo_megatron.algo.rewards.registry"),
        ("dapo_megatron.ckpt.convert", "dapo_megatron.ckpt.loading", "dapo_megatron.ckpt.verify"),
    ]


def test_no_file_refers_outside_the_repository():
    """The repository stands alone: what the code and its readers rely on is in docs/
    (the algorithm as implemented, the design), not in notes a clone does not have."""
    root = PACKAGE.parent
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".sbatch", ".cfg", ".txt", ".json"}
    skipped = {".venv", "runs", ".git", "build"}
    offending = []
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        if not path.is_file() or skipped & set(parts) or parts[0].endswith(".egg-info"):
            continue
        if path.suffix not in suffixes and path.name != "Makefile":
            continue
        text = path.read_text(errors="replace")
        marker = "../" + "shared"  # spelled apart so this file does not find itself
        if marker in text or ("DESIGN" + ".md") in text or ("DAPO" + ".md") in text:
            offending.append(str(path.relative_to(root)))
    assert offending == []
    readme = (root / "README.md").read_text()
    for doc in ("docs/algorithm.md", "docs/design.md"):
        assert (root / doc).is_file() and f"({doc})" in readme


def folder_of(module: str) -> str:
    """The folder ``module`` lives in, as the layers count it: a subpackage's top folder
    (``dapo_megatron.actor.batch`` -> ``actor``), or a loose module of the package's top,
    a layer of its own (``dapo_megatron.config`` -> ``config``); the package itself: ``""``."""
    parts = module.split(".")[1:]
    return parts[0] if parts else ""


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which folders import which other folders (the package's ``__init__`` left out)."""
    folders: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if folder_of(name):
            folders.setdefault(folder_of(name), set()).update(
                folder_of(t) for t in targets if folder_of(t) and folder_of(t) != folder_of(name)
            )
    return folders


def test_folders_import_downward_only():
    """The folders form layers: no folder reaches back up, through any chain of imports, to
    a folder that imports it (the folder graph has no circle, so an order exists in which
    every import points down). A climb names the modules that make it."""
    graph = import_graph()
    circles = _cycles(folder_graph(graph))
    climbs = [
        f"{name} -> {target}"
        for circle in circles
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if {folder_of(name), folder_of(target)} <= set(circle) and folder_of(name) != folder_of(target)
    ]
    assert circles == [], climbs


def test_the_layer_check_sees_a_climb():
    """Negative control: the climb this test was written against (the model builder
    asking the checkpoint mapping for megatron's expert names), put back."""
    graph = import_graph()
    graph["dapo_megatron.models.gpt"].add("dapo_megatron.ckpt.mapping")
    assert _cycles(folder_graph(graph)) == [["ckpt", "models"]]
