"""What a module's source binds at top level, read with `ast` (no import): the tests that check
names across the source (the layer map, benchmarks' imports of harness) share this reading."""

from __future__ import annotations

import ast


def top_level_names(tree: ast.Module) -> set[str]:
    """Definitions, assignment targets and imported names at the top level of `tree`."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names
