"""The package's shape (notes/architecture.md): imports between subpackages form a DAG, the
package root holds at most 10 modules, no module exceeds 450 lines, entry points import no
other entry point, and no library module prints `[harness]` lines past the logger."""

from __future__ import annotations

import ast
from pathlib import Path

from launching import REPO

PKG = REPO / "harness"
ENTRY_POINTS = {"train", "prune", "plan", "export", "experiments"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {n for n in found if n == "harness" or n.startswith("harness.")}


def _unit(module: str) -> str:
    """The unit of layering: a subpackage (`harness.engine`) or a root module (`harness.errors`)."""
    return ".".join(module.split(".")[:2])


def _package_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        src = _unit(name)
        graph.setdefault(src, set())
        for target in _imports(path):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and _unit(target) != src and _unit(target) != "harness":
                graph[src].add(_unit(target))
    return graph


def test_subpackages_import_only_downwards() -> None:
    graph = _package_graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle between packages: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert {"harness.engine", "harness.config"} <= graph["harness.runner"]  # the graph was really built


def test_package_root_and_module_sizes() -> None:
    root = [p for p in PKG.glob("*.py") if p.name != "__init__.py"]
    assert len(root) <= 10, sorted(p.name for p in root)
    long = {str(p.relative_to(REPO)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_entry_points_import_no_other_entry_point() -> None:
    for name in ENTRY_POINTS:
        imported = {m.split(".")[1] for m in _imports(PKG / f"{name}.py") if m.count(".") >= 1}
        assert not (imported & (ENTRY_POINTS - {name})), (name, imported & ENTRY_POINTS)


def test_library_messages_go_through_the_logger() -> None:
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.stem in ENTRY_POINTS or path.name == "log.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print" and node.args:
                first = node.args[0]
                text = ast.unparse(first)
                if "[harness]" in text:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
            func = getattr(node, "func", None)
            if (
                isinstance(node, ast.Call)
                and isinstance(func, ast.Attribute)
                and getattr(func.value, "id", None) == "log"
                and any(k.arg in ("file", "flush") for k in node.keywords)
            ):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} (a logger takes no file=/flush=)")
    assert not offenders, offenders
