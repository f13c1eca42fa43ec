"""The seed table of `prune_recon.py`'s rows: per pattern and variant, holdout and eval perplexity
over seeds (mean +- sd, and each seed), wall and process CPU seconds against SparseGPT's row of
the same seed written within the hour (in practice the same call, one process), and the probe
ledger's peak.

    python benchmarks/prune_recon_table.py --seeds 0 1 2 [--since 2026-11-28T17:00:00Z]

A (pattern, seed, variant) measured more than once keeps its latest row (`when`); `--since`
drops rows written before a time (an earlier code's rows). Reads only the JSONL; runs nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def latest_rows(path: Path, since: str) -> dict[tuple[str, int, str], dict]:
    rows: dict[tuple[str, int, str], dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("when", "") < since:
            continue
        key = (row["pattern"], row["seed"], row["variant"])
        if key not in rows or row["when"] >= rows[key]["when"]:
            rows[key] = row
    return rows


def spread(values: list[float]) -> str:
    if not values:
        return ""
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} +- {sd:.2f}" if len(values) > 1 else f"{mean:.2f}"


def table(rows: dict[tuple[str, int, str], dict], seeds: list[int]) -> str:
    by: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for (pattern, seed, variant), row in rows.items():
        if seed in seeds:
            by[(pattern, variant)][seed] = row
    out = [
        "| pattern | variant | seeds | holdout ppl (each seed) | holdout mean +- sd | eval ppl (each seed) | eval mean +- sd "
        "| wall s (mean) | wall / SparseGPT's (same seed, within the hour) | CPU / SparseGPT's | ledger peak MiB |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (pattern, variant), per_seed in sorted(by.items()):
        got = [per_seed[s] for s in seeds if s in per_seed]
        hold = [r["holdout_ppl"] for r in got]
        evals = [r["eval_ppl"] for r in got if "eval_ppl" in r]
        ratios, cpu_ratios = [], []
        for s, r in per_seed.items():
            base = rows.get((pattern, s, "sparsegpt"))
            if base and variant != "sparsegpt" and abs(_call_gap(base, r)) < 3600:
                ratios.append(r["wall_s"] / base["wall_s"])
                if "cpu_s" in r and "cpu_s" in base:
                    cpu_ratios.append(r["cpu_s"] / base["cpu_s"])
        out.append(
            f"| {pattern} | {variant} | {','.join(str(s) for s in seeds if s in per_seed)} "
            f"| {' / '.join(f'{v:.2f}' for v in hold)} | {spread(hold)} "
            f"| {' / '.join(f'{v:.2f}' for v in evals)} | {spread(evals)} "
            f"| {statistics.fmean(r['wall_s'] for r in got):.0f} "
            f"| {spread(ratios) if ratios else ''} | {spread(cpu_ratios) if cpu_ratios else ''} "
            f"| {max(r.get('peak_probe_bytes', 0) for r in got) / 2**20:.0f} |"
        )
    return "\n".join(out)


def _call_gap(a: dict, b: dict) -> float:
    """Seconds between two rows' writes: rows of one call are minutes apart, not hours."""
    from datetime import datetime

    fmt = "%Y-%m-%dT%H:%M:%SZ"
    return (datetime.strptime(b["when"], fmt) - datetime.strptime(a["when"], fmt)).total_seconds()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="benchmarks/results/pruning/recon_smollm2.jsonl")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--since", default="", help="ignore rows written before this UTC time (ISO, as in `when`)")
    args = ap.parse_args()
    print(table(latest_rows(REPO / args.results, args.since), args.seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
