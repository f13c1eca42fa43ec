"""Per-strategy table for notes/core.md: per-rank bytes, tokens/s and final loss at world N.

    python benchmarks/core_strategies.py --nproc 2 --steps 20     # prints the table (markdown)

Each strategy runs through `torchrun harness/train.py` (the user's entry point) on the
tiny Llama and the embedded corpus; bytes come from the run's state_bytes/rank*.json
(tensors actually held), speed and loss from its metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from harness.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "fsdp", "fsdp_grad_op"]


def launch(config: dict, work: Path, name: str, nproc: int, module: str = "harness/train.py") -> Path:
    """`torchrun --nproc_per_node=nproc <module> --config <work>/<name>.yaml`, its output in <work>/<name>."""
    out = work / name
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**config, "output_dir": str(out)}))
    threads = str(max(1, (os.cpu_count() or 2) // nproc))
    env = dict(os.environ, OMP_NUM_THREADS=threads, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    torchrun = [str(Path(sys.executable).parent / "torchrun"), f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    proc = subprocess.run([*torchrun, str(REPO / module), "--config", str(path)], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return out


def run_one(strategy: str, nproc: int, steps: int, work: Path, precision: str) -> dict:
    cfg = {
        "model": {"name": "tiny-llama"},
        "data": {"seq_len": 128},
        "strategy": strategy,
        "precision": precision,
        "micro_batch_size": 8,
        "grad_accum": 1,
        "steps": steps,
        "eval_batches": 4,
        "logging": {"wandb": False, "progress": False, "plots": False},
        "memory": {"track": False},
    }
    out = launch(cfg, work, strategy, nproc)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    steady = [r["perf/tokens_per_s"] for r in train[2:]] or [r["perf/tokens_per_s"] for r in train]
    ranks = [json.loads((out / "state_bytes" / f"rank{r}.json").read_text())["peak"] for r in range(nproc)]
    return {
        "strategy": strategy,
        "bytes": ranks[0],
        "tokens_per_s": statistics.median(steady),
        "final_loss": train[-1]["train/loss"],
        "eval_loss": [r["eval/loss"] for r in rows if "eval/loss" in r][-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    kib = lambda b: f"{b / 1024:,.0f}"
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only (gloo)'}; "
        f"world {args.nproc}, tiny-llama, seq 128, micro 8, {args.steps} steps, {args.precision}.",
        "",
        "| strategy | params KiB/rank | master KiB/rank | grads KiB/rank | optim state KiB/rank | tokens/s (global, median) | "
        "final train loss | eval loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            r = run_one(strategy, args.nproc, args.steps, Path(tmp), args.precision)
            b = r["bytes"]
            lines.append(
                f"| {strategy} | {kib(b['params'])} | {kib(b['master_params'])} | {kib(b['grads'])} | {kib(b['optim_state'])} "
                f"| {r['tokens_per_s']:,.0f} | {r['final_loss']:.4f} | {r['eval_loss']:.4f} |"
            )
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
