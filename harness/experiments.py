"""The experiment matrix: run configurations side by side and tabulate what each one buys.

    python -m harness.experiments experiments/peak_memory.yaml [--out DIR] [--only a,b]

A matrix file has a `base` run config, a list of `runs` (name, overrides, optional nproc)
and optionally `control` (the row reductions are measured against) and `pareto: true`
(plot peak activation memory against step time, for an activation-memory-budget sweep).
Each run is its own `harness.train` process (torchrun when nproc > 1), so process groups,
compile caches and allocator state never leak from one row into the next.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import imports_done  # the package first: as the program, the imports below run with the collector held

# isort: split
import yaml

from harness.config import apply_overrides, load_config, parse_yaml
from harness.errors import ConfigError, command_errors
from harness.memory import REPORTED

CATEGORIES = REPORTED  # the table's columns
WARMUP_STEPS = 2  # steps excluded from timing: compile and allocator warm-up land here


@dataclass
class Run:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    nproc: int = 1


def _flatten(d: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in d.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value) if not isinstance(value, str) else value}")
    return out


def load_matrix(path: str) -> tuple[dict[str, Any], list[Run], dict[str, Any]]:
    if not os.path.isfile(path):
        raise ConfigError(f"matrix file '{path}' not found")
    data = parse_yaml(Path(path).read_text()) or {}
    unknown = set(data) - {"base", "runs", "control", "pareto", "title"}
    if unknown:
        raise ConfigError(f"{path}: unknown key '{sorted(unknown)[0]}' (valid: base, runs, control, pareto, title)")
    runs = []
    for i, item in enumerate(data.get("runs") or []):
        if not isinstance(item, dict) or "name" not in item:
            raise ConfigError(f"{path}: runs[{i}] needs a name")
        runs.append(Run(item["name"], item.get("overrides") or {}, int(item.get("nproc", 1))))
    if not runs:
        raise ConfigError(f"{path}: no runs")
    return data.get("base") or {}, runs, {k: data.get(k) for k in ("control", "pareto", "title")}


def run_config(base: dict[str, Any], run: Run, out_dir: Path) -> Path:
    """Write the run's resolved config file (validated by loading it)."""
    cfg = json.loads(json.dumps(base))
    apply_overrides(cfg, _flatten(run.overrides) + [f"output_dir={out_dir / 'run'}"])
    path = out_dir / "config.yaml"
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    load_config(str(path))  # fail now, not halfway through the matrix
    return path


def execute(run: Run, config: Path, log: Path, port: int) -> float:
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"))
    if run.nproc > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // run.nproc))
        cmd = [
            str(Path(sys.executable).parent / "torchrun"),
            f"--nproc_per_node={run.nproc}",
            f"--master_port={port}",
            str(Path(__file__).with_name("train.py")),
            "--config",
            str(config),
        ]
    else:
        cmd = [sys.executable, "-m", "harness.train", "--config", str(config)]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"run '{run.name}' failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start


def summarize(run: Run, run_dir: Path, wall: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval" and r.get("eval/perplexity") is not None]
    steady = train[WARMUP_STEPS:] or train
    step_times = [r["perf/step_time_s"] for r in steady]
    cat_max = {c: max((r.get(f"memory/{c}_max_bytes") or 0) for r in train) for c in CATEGORIES}
    totals = [(r.get("memory/total_peak_bytes") or 0) for r in train]
    total = max(totals)
    at_peak_row = train[totals.index(total)]
    at_peak = {c: at_peak_row.get(f"memory/{c}_peak_bytes") or 0 for c in CATEGORIES}
    if not total:  # compiled models: the tracker cannot see inductor's temporaries; sum what it sees
        at_peak = {c: max((r.get(f"memory/{c}_peak_bytes") or 0) for r in train) for c in CATEGORIES}
    device_peak = max((r.get("memory/max_allocated_bytes") or 0) for r in train)
    warmup = sum(r["perf/step_time_s"] for r in train[:WARMUP_STEPS]) - WARMUP_STEPS * statistics.median(step_times)
    return {
        "name": run.name,
        "nproc": run.nproc,
        "overrides": run.overrides,
        "peak_bytes": device_peak or total or sum(at_peak.values()),
        "peak_source": "max_memory_allocated" if device_peak else "MemTracker" if total else "sum of categories (compiled)",
        "peak_by_category": at_peak,
        "category_max": cat_max,
        "tracked_total_bytes": total,
        "samples_per_s": statistics.median(r["perf/samples_per_s"] for r in steady),
        "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in steady),
        "step_time_s": statistics.median(step_times),
        "train_time_s": sum(step_times),
        "warmup_s": max(0.0, warmup),
        "eval_perplexity": evals[-1]["eval/perplexity"] if evals else None,
        "final_loss": train[-1]["train/loss"],
        "wall_s": wall,
    }


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f}" if b >= 2**27 else f"{b / 2**20:.1f} MiB"


def write_table(results: list[dict[str, Any]], control: str | None, out: Path, title: str) -> str:
    ctrl = next((r for r in results if r["name"] == control), results[0])
    lines = [
        f"# {title}",
        "",
        "| configuration | ranks | peak memory | reduction vs control | samples/s | tokens/s "
        "| step time (s) | steady wall time (s, excl. warm-up) | warm-up/compile (s) | eval perplexity |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        red = 1 - r["peak_bytes"] / ctrl["peak_bytes"] if ctrl["peak_bytes"] else 0.0
        ppl = f"{r['eval_perplexity']:.2f}" if r["eval_perplexity"] is not None else "-"
        mark = "*" if r["peak_source"].startswith("sum") else ""
        lines.append(
            f"| {r['name']} | {r['nproc']} | {_gib(r['peak_bytes'])}{mark} | {red:+.1%} | {r['samples_per_s']:.2f} "
            f"| {r['tokens_per_s']:,.0f} | {r['step_time_s']:.3f} | {r['train_time_s']:.1f} | {r['warmup_s']:.1f} | {ppl} |"
        )
    lines += [
        "",
        "Peak memory is per rank: "
        + (
            "`torch.cuda.max_memory_allocated`"
            if ctrl["peak_source"] == "max_memory_allocated"
            else "torch's MemTracker on real CPU tensors (all live tensors at the peak moment)"
        )
        + ". "
        "`*`: a compiled model, whose inductor temporaries the CPU tracker cannot see: the sum of the "
        "categories it does see (a lower bound).",
    ]
    for heading, key in (
        ("Split at the peak moment (MiB per rank; the stacked chart):", "peak_by_category"),
        ("Each category's own maximum over the run (MiB per rank; not simultaneous):", "category_max"),
    ):
        lines += ["", heading, "", "| configuration | " + " | ".join(CATEGORIES) + " |", "|---|" + "---:|" * len(CATEGORIES)]
        for r in results:
            lines.append(f"| {r['name']} | " + " | ".join(f"{r[key][c] / 2**20:.2f}" for c in CATEGORIES) + " |")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return text


def plot(results: list[dict[str, Any]], out: Path, pareto: bool) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    paths = []
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names)), 4.5))
    bottom = [0.0] * len(results)
    for c in CATEGORIES:
        vals = [r["peak_by_category"][c] / 2**20 for r in results]
        ax.bar(names, vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB per rank, split at the peak moment")
    ax.set_title("Peak memory by category")
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=40, ha="right", fontsize=8)
    fig.tight_layout()
    paths.append(out / "peak_memory_by_category.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names)), 4))
    ax.bar(names, [r["samples_per_s"] for r in results], color="tab:green")
    ax.set_ylabel("samples/s (median, after warm-up)")
    plt.setp(ax.get_xticklabels(), rotation=40, ha="right", fontsize=8)
    fig.tight_layout()
    paths.append(out / "samples_per_s.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if pareto:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        xs = [r["step_time_s"] for r in results]
        ys = [r["category_max"]["activations"] / 2**20 for r in results]
        ax.plot(xs, ys, "o-")
        for r, x, y in zip(results, xs, ys):
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("step time (s, median)")
        ax.set_ylabel("peak activation memory (MiB)")
        ax.set_title("Activation memory budget: memory vs time")
        fig.tight_layout()
        paths.append(out / "budget_pareto.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


@command_errors("harness.experiments")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harness.experiments", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("matrix")
    parser.add_argument("--out", default=None, help="output directory (default runs/experiments/<matrix name>)")
    parser.add_argument("--only", default=None, help="comma-separated run names")
    parser.add_argument("--set", nargs="*", default=[], help="base overrides key=value applied to every run")
    parser.add_argument("--resume", action="store_true", help="reuse rows that already finished in --out")
    args = parser.parse_args(argv)
    base, runs, meta = load_matrix(args.matrix)
    apply_overrides(base, args.set)
    if args.only:
        wanted = set(args.only.split(","))
        runs = [r for r in runs if r.name in wanted]
    out = Path(args.out or Path("runs") / "experiments" / Path(args.matrix).stem)
    configs = [(r, run_config(base, r, out / r.name.replace(" ", "_").replace("/", "-"))) for r in runs]
    results = []
    for i, (run, config) in enumerate(configs):
        done = config.parent / "done.json"
        if args.resume and done.exists():
            wall = json.loads(done.read_text())["wall_s"]
            print(f"[{i + 1}/{len(configs)}] {run.name}: reusing the finished run", flush=True)
        else:
            print(f"[{i + 1}/{len(configs)}] {run.name} ...", flush=True)
            wall = execute(run, config, config.parent / "log.txt", 29600 + i)
            done.write_text(json.dumps({"wall_s": wall}))
        results.append(summarize(run, config.parent / "run", wall))
    print(write_table(results, meta.get("control"), out, meta.get("title") or Path(args.matrix).stem))
    for p in plot(results, out, bool(meta.get("pareto"))):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    imports_done()
    sys.exit(main())
