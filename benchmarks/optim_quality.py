"""Quality of the low-precision optimizer states on a real fine-tune: SmolLM2-135M, full fine-tune
through `python -m harness.train`, one run per optimizer and seed, eval loss vs fp32-state AdamW.

    python benchmarks/optim_quality.py [--steps 200] [--seeds 3] [--seq-len 64] [--micro-batch 1]
        [--lr 2e-5] [--optimizers adamw,adamw_bf16,adamw_bf16_sr,adamw_8bit,adamw_4bit,paged_adamw_8bit]

Every run but one is the same full fine-tune of the pretrained weights in fp32 (`precision=fp32`:
fp32 weights, so every optimizer is compared with fp32-state AdamW at the same precision, lr and
schedule; only the optimizer's state differs; `adamw_bf16` keeps bf16 moments). The exception is
`adamw_bf16_sr`: the same bf16-state AdamW over bf16 weights with no fp32 master
(`precision=bf16_pure`), where torchao rounds each update stochastically; it is compared with the
same fp32 AdamW, so its figure includes the cost of dropping the master copy. The data
is harness's embedded corpus (pydoc topics and standard-library sources, split by a seeded hash
of each document: the eval documents are never trained on). A "seed" is `data.seed` (which
documents are held out, and the order of the training blocks) and `seed`: a pretrained model
without dropout has no other randomness, so the seeds differ in data, and each optimizer is
compared with AdamW of the same seed (same eval documents, same batches).

Each finished run is written to the JSON at once (`--out`), and a run already there is not run
again: an interrupted sweep continues where it stopped. At the end: the markdown table (per run,
and the mean over seeds against the target: bf16 and 8-bit within 1%, 4-bit within 2%), the
loss-curve PNG (`--png`). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")  # before pyplot: files only, no display
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import real_model  # noqa: E402

OPTIMIZERS = ("adamw", "adamw_bf16", "adamw_bf16_sr", "adamw_8bit", "adamw_4bit", "paged_adamw_8bit")
# A run name is an `optim.name`, except "adamw_bf16_sr": torchao's bf16 AdamW over bf16 weights with no
# fp32 master (`precision=bf16_pure`), the one run where its stochastic rounding of the update acts.
RUNS = {"adamw_bf16_sr": ("adamw_bf16", "bf16_pure")}
TARGET = {"adamw_bf16": 0.01, "adamw_bf16_sr": 0.01, "adamw_8bit": 0.01, "paged_adamw_8bit": 0.01, "adamw_4bit": 0.02}
BASELINE = "adamw"
DATA_SEED = 1234  # harness's data.seed default; seed s runs with DATA_SEED + s


def run_config(model: Path, run: str, seed: int, steps: int, args: argparse.Namespace, work: Path) -> dict:
    optimizer, precision = RUNS.get(run, (run, "fp32"))
    return {
        "model": {"name": str(model)},
        "data": {"source": args.source, "seq_len": args.seq_len, "seed": DATA_SEED + seed, "cache_dir": str(work / "data")},
        "precision": precision,
        "micro_batch_size": args.micro_batch,
        "grad_accum": 1,
        "steps": steps,
        "eval_every": args.eval_every if steps > args.eval_every else 0,
        "eval_batches": args.eval_batches,
        "seed": seed,
        "optim": {"name": optimizer, "lr": args.lr, "warmup_steps": args.warmup},
        "memory": {"track": False},  # quality only: the per-step memory split costs 2x-40x a step on the shared CPU
        "logging": {"wandb": False, "progress": False, "plots": False},
        "output_dir": str(work / f"{run}-seed{seed}-{steps}"),
    }


def train(cfg: dict, work: Path) -> list[dict]:
    """One `python -m harness.train` run (niced: the machine is shared); its metrics.jsonl rows."""
    path = work / (Path(cfg["output_dir"]).name + ".yaml")
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    cmd = ["nice", "-n", "19", sys.executable, "-m", "harness.train", "--config", str(path)]
    log = Path(cfg["output_dir"] + ".log")
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}; its log: {log}\n{log.read_text()[-3000:]}")
    metrics = Path(cfg["output_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def summarize(rows: list[dict], wall: float) -> dict:
    steps = [r for r in rows if "train/loss" in r]
    evals = [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r]
    times = [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r]
    return {
        "final_eval_loss": evals[-1][1],
        "eval_curve": evals,
        "train_loss": [r["train/loss"] for r in steps],
        "median_step_s": statistics.median(times[2:] or times),
        "first_step_s": times[0],
        "wall_s": round(wall, 1),
    }


def table(results: dict, optimizers: list[str], seeds: list[int]) -> tuple[list[str], dict]:
    """Markdown rows per run and per optimizer (mean over seeds), and the verdicts."""
    lines = ["| optimizer | seed | final eval loss | vs adamw (same seed) | median step (s) |", "|---|---:|---:|---:|---:|"]
    verdicts = {}
    for name in optimizers:
        rel = []
        for s in seeds:
            run, base = results.get(f"{name}/{s}"), results.get(f"{BASELINE}/{s}")
            if run is None or base is None:
                continue
            d = (run["final_eval_loss"] - base["final_eval_loss"]) / base["final_eval_loss"]
            rel.append(d)
            lines.append(f"| {name} | {s} | {run['final_eval_loss']:.5f} | {d:+.4%} | {run['median_step_s']:.2f} |")
        if rel and name != BASELINE:
            mean = statistics.fmean(rel)
            worst = max(rel, key=abs)
            met = abs(mean) <= TARGET[name] and abs(worst) <= TARGET[name]
            verdicts[name] = {"mean_rel": mean, "worst_rel": worst, "seeds": len(rel), "target": TARGET[name], "met": met}
    lines += ["", "| optimizer | seeds | mean vs adamw | worst seed | target | met |", "|---|---:|---:|---:|---:|---|"]
    for name, v in verdicts.items():
        met = "yes" if v["met"] else "NO"
        lines.append(f"| {name} | {v['seeds']} | {v['mean_rel']:+.4%} | {v['worst_rel']:+.4%} | within {v['target']:.0%} | {met} |")
    return lines, verdicts


def plot(results: dict, optimizers: list[str], seeds: list[int], png: Path, title: str) -> None:
    """Left: training loss per step of the first seed (every optimizer sees the same batches, so the
    curves are paired); middle: each step's training loss relative to AdamW's on that same batch
    (the loss of step t is taken before step t's update: a held-out batch for the weights so far);
    right: final held-out eval loss relative to AdamW, one point per seed."""
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, name in enumerate(optimizers):
        runs = {s: results[f"{name}/{s}"] for s in seeds if f"{name}/{s}" in results}
        if not runs:
            continue
        n = min(len(r["train_loss"]) for r in runs.values())
        first = runs[min(runs)] if min(runs) == seeds[0] else None  # one seed: the seeds' batches differ
        if first is not None:
            left.plot(range(1, n + 1), first["train_loss"][:n], label=name, lw=1.2)
        paired = {s: results[f"{BASELINE}/{s}"] for s in runs if f"{BASELINE}/{s}" in results}
        if name == BASELINE or not paired:
            continue
        rel = [statistics.fmean((runs[s]["train_loss"][j] / b["train_loss"][j] - 1) * 100 for s, b in paired.items()) for j in range(n)]
        mid.plot(range(1, n + 1), rel, label=name, lw=1.2, color=f"C{i}")
        for s, b in paired.items():
            right.scatter(
                i, (runs[s]["final_eval_loss"] / b["final_eval_loss"] - 1) * 100, color=f"C{i}", label=name if s == min(paired) else None
            )
    left.set(xlabel="step", ylabel=f"train loss, seed {seeds[0]}", title="training loss (same batches for all)")
    mid.set(xlabel="step", ylabel="train loss vs adamw, same batch (%)", title="per-step difference to fp32 AdamW")
    right.set(xlabel="optimizer", ylabel="final held-out eval loss vs adamw (%)", title="held-out eval (targets: 1% / 4-bit 2%)")
    right.set_xticks(range(len(optimizers)), optimizers, rotation=20, fontsize=7)
    for ax in (left, mid, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed-list", type=lambda s: [int(x) for x in s.split(",")], default=None, help="run only these seeds")
    parser.add_argument("--report-only", action="store_true", help="no new runs: the table and PNG of the runs held")
    parser.add_argument("--merge", type=Path, action="append", default=[], help="another sweep's JSON (same setup) to take runs from")
    parser.add_argument("--optimizers", type=lambda s: s.split(","), default=list(OPTIMIZERS))
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--source", default="embedded")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path("/tmp/harness_optim_quality"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "optimizers" / "optimizers_quality.json")
    parser.add_argument("--png", type=Path, default=REPO / "benchmarks" / "results" / "optimizers" / "optimizers_quality.png")
    args = parser.parse_args()
    if BASELINE not in args.optimizers:
        args.optimizers.insert(0, BASELINE)

    model = real_model.prepare()
    args.work.mkdir(parents=True, exist_ok=True)

    setup = {k: getattr(args, k) for k in ("steps", "seq_len", "micro_batch", "lr", "warmup", "source", "eval_every", "eval_batches")}
    saved = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = saved.get("runs", {}) if saved.get("setup") == setup else {}
    for other in args.merge:  # runs made by another process (a sweep split by seed), same setup only
        theirs = json.loads(other.read_text())
        if theirs.get("setup") != setup:
            raise SystemExit(f"--merge {other}: its setup {theirs.get('setup')} is not this sweep's {setup}")
        results = {**theirs["runs"], **results}
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    for s in seeds:  # seed-major: every optimizer of a seed before the next seed, so a cut sweep compares fully
        for name in args.optimizers:
            key = f"{name}/{s}"
            if key in results or args.report_only:
                continue
            started = time.time()
            results[key] = summarize(train(run_config(model, name, s, args.steps, args, args.work), args.work), time.time() - started)
            args.out.write_text(json.dumps({"setup": setup, "runs": results}, indent=1))
            print(f"{key}: eval loss {results[key]['final_eval_loss']:.5f}, {results[key]['wall_s']:.0f} s", flush=True)

    lines, verdicts = table(results, args.optimizers, seeds)
    print("\n".join(lines))
    args.out.write_text(json.dumps({"setup": setup, "runs": results, "verdicts": verdicts}, indent=1))
    title = (
        f"SmolLM2-135M full fine-tune, fp32 weights, {args.steps} steps x {args.micro_batch} x {args.seq_len} tokens, "
        f"lr {args.lr:g} (warmup {args.warmup}, cosine), seeds {','.join(map(str, seeds))} (runs held), embedded corpus (held-out eval)"
    )
    plot(results, args.optimizers, seeds, args.png, title)
    print(json.dumps({"setup": setup, "verdicts": verdicts, "png": str(args.png)}))


if __name__ == "__main__":
    main()
