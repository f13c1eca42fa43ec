"""Ulysses sequence parallelism against one process, on one model and sequence length: the same
run (same data, seed and steps, fp32) at world 1 and at world N with `parallel.sequence=N`
(a data-parallel size of 1: the N ranks share every sample, each holding 1/N of its tokens).

    python benchmarks/sequence_parallel.py [--model real|<preset or dir>] [--seq-len 4096] [--steps 2] [--strategy fsdp] [--sequence 2]
        [--set memory.activation_checkpointing=full ...]

Reported per step: both runs' losses and gradient norms and their largest relative
difference, and the per-rank activation peak measured by harness's own per-category tracker
(`memory.track`, every step split by category: `memory/activations_max_bytes`, the largest over
the ranks) with the ratio N / 1, and the step times. `--model real` is SmolLM2-135M-Instruct
(benchmarks/real_model.py). Each run goes through the user's entry points (`python -m
harness.train`, `torchrun harness/train.py`). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "benchmarks"))
import real_model  # noqa: E402


def write_config(path: Path, model: str, seq_len: int, steps: int, cache: Path, output: Path) -> Path:
    cfg = {
        "model": {"name": model},
        "data": {"seq_len": seq_len, "max_tokens": 8 * seq_len * (steps + 2), "cache_dir": str(cache)},
        "micro_batch_size": 1,
        "grad_accum": 1,
        "steps": steps,
        "eval_batches": 1,
        "optim": {"lr": 1e-5, "warmup_steps": 0, "grad_clip": 0.0},
        "memory": {"track": True, "track_every": 1},
        "logging": {"wandb": False, "progress": False, "plots": False},
        "output_dir": str(output),
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-4000:]}")


def steps_of(output: Path) -> list[dict]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "train/loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="real", help="'real' (SmolLM2-135M), a preset or a model directory")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--strategy", default="fsdp", help="the world-N run's: fsdp, ddp, or a DeepSpeed stage (zero2, zero3, a file): ALST"
    )
    parser.add_argument("--sequence", type=int, default=2, help="N: the world-N run's parallel.sequence (SmolLM2's 9 heads, 3 kv heads: 3)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for both runs")
    parser.add_argument("--work", type=Path, default=None, help="where runs and the data cache go (default: a temp dir)")
    args = parser.parse_args()
    model = str(real_model.prepare()) if args.model == "real" else args.model
    work = args.work or Path(tempfile.mkdtemp(prefix="sp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    one = write_config(work / "w1.yaml", model, args.seq_len, args.steps, cache, work / "w1")
    run([sys.executable, "-m", "harness.data", "--config", str(one)])  # prepared once, outside both timings
    run([sys.executable, "-m", "harness.train", "--config", str(one), *args.set])
    two = write_config(work / "sp2.yaml", model, args.seq_len, args.steps, cache, work / "sp2")
    run([str(BIN / "torchrun"), f"--nproc_per_node={args.sequence}", "--master_port=29651", "harness/train.py", "--config", str(two),
         f"strategy={args.strategy}", f"parallel.sequence={args.sequence}", *args.set])  # fmt: skip
    a, b = steps_of(work / "w1"), steps_of(work / "sp2")
    rows = []
    for step, (x, y) in enumerate(zip(a, b), start=1):
        rows.append(
            {
                "step": step,
                "loss_w1": x["train/loss"],
                "loss_sp2": y["train/loss"],
                "grad_norm_w1": x["train/grad_norm"],
                "grad_norm_sp2": y["train/grad_norm"],
                "act_w1": x.get("memory/activations_max_bytes"),
                "act_sp2": y.get("memory/activations_max_bytes"),
                "step_s_w1": x["perf/step_time_s"],
                "step_s_sp2": y["perf/step_time_s"],
            }
        )
    loss_rel = max(abs(r["loss_sp2"] - r["loss_w1"]) / abs(r["loss_w1"]) for r in rows)
    norm_rel = max(abs(r["grad_norm_sp2"] - r["grad_norm_w1"]) / abs(r["grad_norm_w1"]) for r in rows)
    ratio = max(r["act_sp2"] / r["act_w1"] for r in rows if r["act_w1"] and r["act_sp2"])
    n = args.sequence
    extra = " ".join(args.set)
    print(f"model {model}, seq {args.seq_len}, {args.strategy} x{n} parallel.sequence={n} vs one process, fp32, micro-batch 1 {extra}")
    columns = ["step", "loss N=1", f"loss N={n}", "grad norm N=1", f"grad norm N={n}", "activations N=1 (MiB)", f"N={n} per rank (MiB)"]
    print("| " + " | ".join([*columns, "ratio", "step s"]) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['step']} | {r['loss_w1']:.6f} | {r['loss_sp2']:.6f} | {r['grad_norm_w1']:.6f} | {r['grad_norm_sp2']:.6f} | "
            f"{r['act_w1'] / 2**20:.1f} | {r['act_sp2'] / 2**20:.1f} | {r['act_sp2'] / r['act_w1']:.3f} | "
            f"{r['step_s_w1']:.1f} / {r['step_s_sp2']:.1f} |"
        )
    print(f"largest relative difference: loss {loss_rel:.2e}, grad norm {norm_rel:.2e}; activation peak ratio (worst step) {ratio:.3f}")
    print(json.dumps({"model": model, "seq_len": args.seq_len, "strategy": args.strategy, "sequence": n, "rows": rows, "loss_rel": loss_rel,
                      "grad_norm_rel": norm_rel, "activation_ratio": ratio}))  # fmt: skip


if __name__ == "__main__":
    main()
