"""The package's shape, checked against the map (notes/architecture.md) by reading the source.

The map declares two tables this file parses, so the map and the code cannot drift apart:
the layer table (a package imports only packages on lower layers; entry points none of each
other) and the table of function-local imports (the only imports allowed inside functions,
each with its reason, and their total count). Every import is read with `ast`, module-level
and function-local, relative ones resolved. Also: from outside a package, imports go through
its surface (`from harness.config import RunConfig`, never `harness.config.schema`); no
docstring or comment names a `harness.` module or a repository file that does not exist; the
package root holds at most 10 modules, none over 450 lines; library messages go through the
logger.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from launching import REPO
from source_names import top_level_names

PKG = REPO / "harness"
MAP = REPO / "notes" / "architecture.md"
ENTRY = -1  # the layer of the entry points: above every package, importing none of each other


@dataclass(frozen=True)
class Import:
    module: str  # the importing module (`harness.runner.loop`)
    line: int
    target: str  # the module imported, relative imports resolved (`harness.config`, `deepspeed.utils`)
    names: tuple[str, ...]  # for `from X import a, b`: ("a", "b"); for `import X`: ()
    local: bool  # inside a function


@cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _unit(module: str) -> str:
    """The unit of layering: a subpackage (`harness.engine`) or a root module (`harness.errors`)."""
    return ".".join(module.split(".")[:2])


def _is_package(unit: str) -> bool:
    return (REPO / Path(*unit.split(".")) / "__init__.py").exists()


def _imports_of(module: str) -> list[Import]:
    path = _modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(module, child.lineno, a.name, (), local) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join(parts + ([target] if target else []))
                found.append(Import(module, child.lineno, target, tuple(a.name for a in child.names), local))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(_tree(path), False)
    return found


def _all_imports() -> list[Import]:
    return [imp for module in _modules() for imp in _imports_of(module)]


def _harness_targets(imp: Import) -> set[str]:
    """The harness modules an import loads: `from harness import errors` loads `harness.errors`."""
    modules = _modules()
    out = set()
    bound = _defined(imp.target) if imp.target in modules else set()  # `from harness.planner import estimate`: the function
    for name in [imp.target] + [f"{imp.target}.{n}" for n in imp.names if n not in bound]:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules and name != "harness":
            out.add(name)
    return out


# ------------------------------------------------------------------------------- the map's tables


def _table(heading: str) -> list[list[str]]:
    """The rows (cells, stripped) of the markdown table whose header line starts with `heading`."""
    lines = MAP.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    assert start is not None, f"{MAP.relative_to(REPO)} has no '{heading}' table"
    rows, seen = [], False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            seen = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif seen:
            break
    return rows


def _units_in(cell: str) -> list[str]:
    """`runner/` -> harness.runner, `errors.py` -> harness.errors (the backticked names of a cell)."""
    return ["harness." + name.removesuffix("/").removesuffix(".py") for name in re.findall(r"`([\w./]+)`", cell)]


@cache
def _layers() -> dict[str, int]:
    layers = {}
    for cells in _table("| layer | package |"):
        layer = ENTRY if cells[0] == "entry" else int(cells[0])
        for unit in _units_in(cells[1]):
            layers[unit] = layer
    assert layers, "the map's layer table is empty"
    return layers


@cache
def _local_allowed() -> dict[tuple[str, str], str]:
    """(unit, imported module or its prefix) -> the reason it is imported inside functions."""
    allowed = {}
    for cells in _table("| package | imported inside functions |"):
        for unit in _units_in(cells[0]):
            for target in re.findall(r"`([\w.]+)`", cells[1]):
                allowed[(unit, target)] = cells[2]
    assert allowed and all(allowed.values()), "the map's function-local import table is empty or gives no reason"
    return allowed


def _covers(prefix: str, target: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


# ------------------------------------------------------------------------------- layers and cycles


def test_every_package_is_on_the_map_and_every_row_exists() -> None:
    units = {_unit(m) for m in _modules() if m != "harness"}
    layers = _layers()
    assert not units - set(layers), f"not on the map's layer table ({MAP.relative_to(REPO)}): {sorted(units - set(layers))}"
    assert not set(layers) - units, f"on the map but not in harness/: {sorted(set(layers) - units)}"


def test_imports_follow_the_declared_layers() -> None:
    layers = _layers()
    offenders = []
    for imp in _all_imports():
        src = _unit(imp.module)
        for target in _harness_targets(imp):
            dst = _unit(target)
            if dst == src:
                continue
            if layers[dst] == ENTRY:
                offenders.append(f"{imp.module}:{imp.line} imports the entry point {dst}")
            elif layers[src] != ENTRY and layers[dst] >= layers[src]:
                offenders.append(f"{imp.module}:{imp.line} ({src}, layer {layers[src]}) imports {target} (layer {layers[dst]})")
    assert not offenders, "imports against the map's layer order:\n" + "\n".join(sorted(set(offenders)))


def test_subpackages_import_without_cycles() -> None:
    """Implied by the layer order; kept so that a cycle is named as one."""
    graph: dict[str, set[str]] = {}
    for imp in _all_imports():
        graph.setdefault(_unit(imp.module), set()).update(_unit(t) for t in _harness_targets(imp) if _unit(t) != _unit(imp.module))
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


# ------------------------------------------------------------------------------- package surfaces


def test_other_packages_are_imported_through_their_surface() -> None:
    """`from harness.config import X`, not `from harness.config.schema import X` (entry points excepted: the map)."""
    layers = _layers()
    offenders = []
    for imp in _all_imports():
        src = _unit(imp.module)
        if layers.get(src) == ENTRY:
            continue
        for target in _harness_targets(imp):
            dst = _unit(target)
            if dst != src and _is_package(dst) and target != dst:
                offenders.append(f"{imp.module}:{imp.line} imports {target} (use `from {dst} import ...`)")
    assert not offenders, "imports past a package's surface:\n" + "\n".join(sorted(set(offenders)))


# ------------------------------------------------------------------------------- function-local imports


def test_function_local_imports_are_the_ones_the_map_lists() -> None:
    allowed = _local_allowed()
    local = [imp for imp in _all_imports() if imp.local]
    used = set()
    offenders = []
    for imp in local:
        keys = [key for key in allowed if key[0] == _unit(imp.module) and _covers(key[1], imp.target)]
        if keys:
            used.update(keys)
        else:
            offenders.append(f"{imp.module}:{imp.line} imports {imp.target} inside a function")
    assert not offenders, (
        "function-local imports the map does not list (move them to the module's top, or add a row with the reason to "
        "the map's function-local import table):\n" + "\n".join(offenders)
    )
    unused = sorted(set(allowed) - used)
    assert not unused, f"rows of the map's function-local import table that no import uses any more: {unused}"
    stated = re.search(r"(\d+) function-local imports", MAP.read_text())
    assert stated, "the map states no count of function-local imports ('N function-local imports')"
    assert int(stated.group(1)) == len(local), f"the map says {stated.group(1)} function-local imports; the source has {len(local)}"


# ------------------------------------------------------------------------------- names in text


def _defined(module: str) -> set[str]:
    """Top-level names of a module: definitions, assignments, imports (a package: what its __init__ binds)."""
    return top_level_names(_tree(_modules()[module]))


def _dotted_name_exists(name: str) -> bool:
    """`harness.x.y[.attr]`: the longest module prefix exists below the root, and the next part is defined in it."""
    modules = _modules()
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        module = ".".join(parts[:i])
        if module in modules:
            return i == len(parts) or parts[i] in _defined(module) or f"{module}.{parts[i]}" in modules
    return False


PATH_RE = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w.-]+\.(?:py|md|json|yaml|sh|sbatch))\b")
MD_RE = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
DOTTED_RE = re.compile(r"\bharness(?:\.\w+)+")
NUMBERED_RE = re.compile(r"\b[Rr]eference[- ]\d{3}\b")  # "reference 003": a document outside this repository


def _path_exists(ref: str, where: Path) -> bool:
    return any((base / ref).exists() for base in (REPO, PKG, where.parent))


def _text_offenders(path: Path, files_too: bool, md_names: set[str]) -> list[str]:
    offenders = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        where = f"{path.relative_to(REPO)}:{lineno}"
        offenders += [f"{where}: {n} (no such module or name)" for n in DOTTED_RE.findall(line) if not _dotted_name_exists(n)]
        offenders += [f"{where}: '{m}' (a document outside the repository)" for m in NUMBERED_RE.findall(line)]
        if files_too:
            paths = PATH_RE.findall(line)
            offenders += [f"{where}: {p} (no such file)" for p in paths if not _path_exists(p, path)]
            offenders += [
                f"{where}: {m} (no such document)"
                for m in MD_RE.findall(line)
                if m not in md_names and not any(p.endswith(m) for p in paths)
            ]
    return offenders


def test_text_names_only_modules_and_files_that_exist() -> None:
    """Docstrings, comments and messages of harness/ and tests/ (benchmarks/: module names only, as
    they name the files they write)."""
    md_names = {p.name for p in REPO.rglob("*.md")}
    offenders = []
    for path in sorted([*PKG.rglob("*.py"), *(REPO / "tests").rglob("*.py")]):
        if path != Path(__file__).resolve():  # this file's examples name what does not exist
            offenders += _text_offenders(path, True, md_names)
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        offenders += _text_offenders(path, False, md_names)
    assert not offenders, "text naming what does not exist:\n" + "\n".join(offenders)


def test_the_text_check_finds_what_it_should() -> None:
    assert _dotted_name_exists("harness.config.schema.RunConfig") and _dotted_name_exists("harness.engine.read_model_weights")
    assert not _dotted_name_exists("harness.memory_tracking") and not _dotted_name_exists("harness.config.schema.NoSuchName")
    assert PATH_RE.findall("see notes/missing.md and harness/x.py") == ["notes/missing.md", "harness/x.py"]


# ------------------------------------------------------------------------------- size, entry points, messages


def test_package_root_and_module_sizes() -> None:
    root = [p for p in PKG.glob("*.py") if p.name != "__init__.py"]
    assert len(root) <= 10, sorted(p.name for p in root)
    long = {str(p.relative_to(REPO)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_library_messages_go_through_the_logger() -> None:
    entry_points = {unit for unit, layer in _layers().items() if layer == ENTRY}
    offenders = []
    for path in PKG.rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if module in entry_points or path.name == "log.py":
            continue
        for node in ast.walk(_tree(path)):
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
