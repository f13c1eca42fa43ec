"""Optimizer step time per `optim.name` over SmolLM2-135M's parameters, after warm-up.

    python benchmarks/optim_step_time.py [--warmup 2] [--steps 3] [--rounds 2] [--names adamw,...]

Only the optimizer step differs between the runs of benchmarks/optim_quality.py (forward and
backward are the same), so it is timed alone here, in one process: harness's `build_optimizer`
over the real model's 134,515,008 parameters (all trainable, fp32, as in the quality runs), with
fixed seeded gradients. Per optimizer and round: a fresh optimizer, `--warmup` untimed steps
(torchao compiles its per-tensor step on the first: one compile per distinct shape and state
kind), then `--steps` timed steps. The optimizers take turns round by round so a change of load
on a shared machine falls on all of them alike. Reported: the median timed step per optimizer,
its ratio to fp32 AdamW, and the first (compiling) step. The last line is JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from harness.config import OptimConfig
from harness.training import build_optimizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import real_model  # noqa: E402

NAMES = ("adamw", "adamw_bf16", "adamw_8bit", "adamw_4bit", "paged_adamw_8bit")


def timed_steps(params: list[torch.nn.Parameter], name: str, warmup: int, steps: int) -> tuple[float, list[float]]:
    """(first step seconds, timed step seconds) of a fresh optimizer ``name`` over ``params``."""
    opt = build_optimizer(params, OptimConfig(name=name, lr=1e-5))
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    del opt
    gc.collect()
    return times[0], times[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--names", type=lambda s: s.split(","), default=list(NAMES))
    args = parser.parse_args()

    model = AutoModelForCausalLM.from_pretrained(str(real_model.prepare()), dtype=torch.float32)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    numel = sum(p.numel() for p in params)
    first: dict[str, list[float]] = {n: [] for n in args.names}
    timed: dict[str, list[float]] = {n: [] for n in args.names}
    for r in range(args.rounds):
        for name in args.names:
            f, t = timed_steps(params, name, args.warmup, args.steps)
            first[name].append(f)
            timed[name] += t
            print(f"round {r} {name}: first step {f:.2f} s, then {', '.join(f'{x:.2f}' for x in t)} s", flush=True)
    base = statistics.median(timed["adamw"]) if "adamw" in timed else None
    print(f"| optimizer | median step (s), {len(params)} tensors, {numel:,} params | vs adamw | first step (s) |")
    print("|---|---:|---:|---:|")
    result = {}
    for name in args.names:
        med = statistics.median(timed[name])
        ratio = f"{med / base:.2f}x" if base else "-"
        print(f"| {name} | {med:.2f} | {ratio} | {', '.join(f'{x:.1f}' for x in first[name])} |")
        result[name] = {"median_step_s": med, "first_step_s": first[name], "timed_s": timed[name]}
    print(json.dumps({"params": numel, "tensors": len(params), "threads": torch.get_num_threads(), "optimizers": result}))


if __name__ == "__main__":
    main()
