"""Recovery after pruning: eval perplexity against masked fine-tuning steps, from the world-2 rows.

    R=benchmarks/results/pruning
    python benchmarks/prune_recovery.py $R/results_smollm2.json --png $R/recovery_smollm2.png

Reads the `finetune_world2` rows `prune_bench.py --finetune-world2 METHOD:PATTERN:STEPS
--finetune-eval-every N` wrote (each a `curve` of [step, eval perplexity]; the `dense` row is
the unpruned model fine-tuned the same way), prints one markdown table (perplexity at each
evaluated step, and the last one against the dense model before and after its own fine-tune)
and draws the curves. A table holds the rows that share steps, learning rate, micro-batch and
eval set (one table per such setup); rows without a curve (a workflow check) are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, no display
import matplotlib.pyplot as plt

SETUP = ("finetune_steps", "lr", "micro_batch_size_per_rank", "eval_sequences")


def by_setup(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """The rows with a curve, grouped by setup (steps, lr, micro-batch, eval set); within a group a
    later row replaces an earlier one of the same method and pattern. Largest group first."""
    groups: dict[tuple, dict[tuple[str, str], dict[str, Any]]] = {}
    for r in rows:
        if len(r.get("curve", [])) > 1:
            groups.setdefault(tuple(r[k] for k in SETUP), {})[(r["method"], r.get("pattern", ""))] = r
    return {k: list(v.values()) for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))}


def table(rows: list[dict[str, Any]]) -> str:
    dense = next((r for r in rows if r["method"] == "dense"), None)
    before = next((r["eval_perplexity_before"] for r in rows if "eval_perplexity_before" in r), None)
    steps = sorted({s for r in rows for s, _ in r["curve"] if s > 0})
    head = ["method", "pattern", "pruned (step 0)", *[f"step {s}" for s in steps], "last vs dense", "last vs dense fine-tuned"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dense_ft = dense["eval_perplexity_finetuned"] if dense else None
    for r in sorted(rows, key=lambda r: (r["method"] != "dense", r.get("pattern", ""), r["eval_perplexity_finetuned"])):
        at = dict((s, p) for s, p in r["curve"])
        start = before if r["method"] == "dense" else r["eval_perplexity_pruned"]
        last = r["eval_perplexity_finetuned"]
        cells = [
            r["method"],
            "-" if r["method"] == "dense" else r["pattern"],
            f"{start:.2f}" if start else "-",
            *[f"{at[s]:.2f}" if s in at else "-" for s in steps],
            f"{last / before - 1:+.1%}" if before else "-",
            f"{last / dense_ft - 1:+.1%}" if dense_ft else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(groups: dict[tuple, list[dict[str, Any]]], png: Path) -> None:
    """Every group's curves on one axis (a dashed line for a group other than the largest)."""
    rows = [r for group in groups.values() for r in group]
    before = next((r["eval_perplexity_before"] for r in rows if "eval_perplexity_before" in r), None)
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, group in enumerate(groups.values()):
        for r in group:
            points = ([[0, before]] if r["method"] == "dense" and before else []) + r["curve"]
            name = "dense (not pruned)" if r["method"] == "dense" else f"{r['method']} {r['pattern']}"
            label = name if len(groups) == 1 else f"{name}, {r['finetune_steps']} steps"
            ax.plot(
                [s for s, _ in points], [p for _, p in points], marker="o", markersize=3, linestyle="-" if i == 0 else "--", label=label
            )
    if before:
        ax.axhline(1.1 * before, color="grey", linestyle=":", linewidth=1, label="dense x 1.1 (target)")
    ax.set_yscale("log")
    ax.set_xlabel("masked fine-tuning steps (FSDP2, world 2)")
    ax.set_ylabel("eval perplexity")
    ax.set_title("SmolLM2-135M: recovery after pruning")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a prune_bench results file with finetune_world2 rows")
    parser.add_argument("--png", default=None, help="write the curves here")
    args = parser.parse_args(argv)
    groups = by_setup(json.loads(Path(args.results).read_text()).get("finetune_world2", []))
    if not groups:
        print(f"no finetune_world2 row with a recovery curve in {args.results}", file=sys.stderr)
        return 1
    for setup, rows in groups.items():
        print(", ".join(f"{k} {v}" for k, v in zip(SETUP, setup)) + ":\n")
        print(table(rows) + "\n")
    if args.png:
        chart(groups, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
