"""Full fine-tune vs LoRA on the same model, same data, same run of this script (notes/lora.md).

    python benchmarks/lora_bench.py --nproc 2 --pretrain-steps 200 --steps 100 [--out benchmarks/results/lora/table.md]

1. Pretrain `small-llama` on the embedded corpus for `--pretrain-steps` and export it: the
   base both fine-tunes start from (a random-init base would make the comparison meaningless).
2. Fine-tune it on synthetic instruction data (tests/launching.instruction_file) twice, with
   the same steps, batch, data order and LR schedule: all parameters, then LoRA (r=8 on every
   block linear, base frozen). Each run goes through `torchrun harness/train.py`.

Reported per run: the tracked step peak per rank (`memory/total_peak_bytes`) and each
category's own maximum during the step (`memory/<category>_max_bytes`, over ranks), the
state held per rank (`state_bytes/rank*.json`), samples/s (median over steps; every
`track_every`-th step also splits its peak and is slower, hence the median) and the eval
loss (response tokens only) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
from core_strategies import launch  # noqa: E402  (torchrun of a config, as core_strategies runs each strategy)
from launching import instruction_file  # noqa: E402  (the tests' instruction data, shared)

CATS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "communication")


def summarize(out: Path, nproc: int) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "train/loss" in r]
    peaks = {c: max((r.get(f"memory/{c}_max_bytes") or 0) for r in train) for c in CATS}  # each category's own maximum
    total = max((r.get("memory/total_peak_bytes") or 0) for r in train)  # the step's peak (all categories at once)
    state = [json.loads((out / "state_bytes" / f"rank{r}.json").read_text())["peak"] for r in range(nproc)]
    return {
        "peaks": peaks,
        "step_peak": total,
        "state": state,
        "samples_per_s": statistics.median(r["perf/samples_per_s"] for r in train[2:]),
        "eval_loss": [r["eval/loss"] for r in rows if "eval/loss" in r][-1],
        "train_loss": train[-1]["train/loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--pretrain-steps", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--lrs", default="1e-3,1e-2", help="LoRA learning rates (the full fine-tune uses the first)")
    parser.add_argument("--out")
    args = parser.parse_args()
    common = {"logging": {"wandb": False, "progress": False, "plots": False}, "strategy": args.strategy, "eval_batches": 8}
    lrs = [float(x) for x in args.lrs.split(",")]
    mib = lambda b: f"{b / 2**20:,.2f}"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = (
            launch(
                {
                    **common,
                    "model": {"name": "small-llama"},
                    "data": {"seq_len": 128, "cache_dir": str(work / "cache")},
                    "micro_batch_size": 8,
                    "steps": args.pretrain_steps,
                    "memory": {"track": False},
                    "checkpoint": {"export_hf": True},
                },
                work,
                "pretrain",
                args.nproc,
            )
            / "hf"
        )
        data = instruction_file(work / "instructions.jsonl", 4000)
        tune = {
            **common,
            "model": {"name": str(base)},
            "steps": args.steps,
            "micro_batch_size": 8,
            "data": {"source": str(data), "format": "instruction", "seq_len": 128, "eval_fraction": 0.1, "cache_dir": str(work / "cache")},
            "optim": {"lr": lrs[0], "warmup_steps": 5},
            "memory": {"track": True, "track_every": 10},
        }
        runs = {f"full fine-tune, lr {lrs[0]:g}": summarize(launch(tune, work, "full", args.nproc), args.nproc)}
        for lr in lrs:
            lora = {**tune, "optim": {"lr": lr, "warmup_steps": 5}, "lora": {"enabled": True, "r": 8, "alpha": 16}}
            runs[f"LoRA r=8, lr {lr:g}"] = summarize(launch(lora, work, f"lora_{lr:g}", args.nproc), args.nproc)
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only (gloo)'}; world {args.nproc} "
        f"({args.strategy}), small-llama pretrained {args.pretrain_steps} steps on the embedded corpus, then {args.steps} steps "
        f"on 4000 instruction records, seq 128, micro 8 per rank, fp32, AdamW, cosine schedule.",
        "",
        "| run | step peak MiB/rank | max params | max grads | max optim state | max activations | max temporaries | max comm | "
        "held after step 1: params / grads / optim MiB/rank | samples/s (median) | eval loss (response tokens) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, r in runs.items():
        p, s = r["peaks"], r["state"][0]
        lines.append(
            f"| {name} | {mib(r['step_peak'])} | {mib(p['parameters'])} | {mib(p['gradients'])} | "
            f"{mib(p['optimizer_state'])} | {mib(p['activations'])} | {mib(p['temporaries'])} | {mib(p['communication'])} | "
            f"{mib(s['params'])} / {mib(s['grads'])} / {mib(s['optim_state'])} | {r['samples_per_s']:.1f} | "
            f"{r['eval_loss']:.4f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
