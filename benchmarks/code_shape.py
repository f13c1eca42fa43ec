"""The codebase's shape, as the redesign measures it: modules over 400 lines, functions over 80,
parameters typed `RunConfig`, and the copies of each vocabulary (unwrap definitions, dtype-name
tables, comparisons of pruning method names, strategy decisions taken on a file's name).

    python benchmarks/code_shape.py [ROOT]      # ROOT: a checkout (default: this one)

Reads source only (`ast` and regular expressions), so it measures any older checkout as well.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

PATTERNS = {
    "unwrap definitions": r"def \w*unwrap\w*\(",
    "dtype-name tables": r"[\"']bf16[\"']\s*:\s*torch\.bfloat16|[\"']bfloat16[\"']\s*:\s*torch",
    "method-name comparisons": r"method\s*(==|!=|in)\s*[\(\[{\"']",
    "strategy-name decisions": r"strategy or \"ddp\"|endswith\(\"offload\"\)",
}


def shape(root: Path) -> dict[str, object]:
    modules = sorted((root / "harness").rglob("*.py"))
    texts = {p: p.read_text() for p in modules}
    long_functions, run_config_params = [], 0
    for path, text in texts.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{path.relative_to(root)}:{node.name}")
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            run_config_params += sum(a.annotation is not None and "RunConfig" in ast.unparse(a.annotation) for a in args)
    out: dict[str, object] = {
        "modules": len(modules),
        "lines": sum(len(t.splitlines()) for t in texts.values()),
        "modules over 400 lines": sorted(str(p.relative_to(root)) for p, t in texts.items() if len(t.splitlines()) > 400),
        "functions over 80 lines": long_functions,
        "RunConfig parameters": run_config_params,
    }
    for name, pattern in PATTERNS.items():
        out[name] = sum(len(re.findall(pattern, t)) for t in texts.values())
    out["result files in notes/"] = sorted(str(p.relative_to(root)) for p in (root / "notes").rglob("*") if p.suffix in (".json", ".png"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    for key, value in shape(Path(parser.parse_args().root)).items():
        print(f"{key}: {len(value) if isinstance(value, list) else value}" + (f"  {value}" if isinstance(value, list) and value else ""))


if __name__ == "__main__":
    main()
