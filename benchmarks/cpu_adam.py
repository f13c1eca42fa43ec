"""Host Adam throughput (parameters stepped per second): DeepSpeed's CPU Adam against torch's AdamW.

    OMP_NUM_THREADS=1 python benchmarks/cpu_adam.py --numel 20000000 --steps 5

The offload rungs of the planner's memory ladder (`harness.planner.ladder`) turn host bytes into
step time with a CPU Adam rate; this measures the rate of the machine it runs on. DeepSpeed's
op (`DeepSpeedCPUAdam`, ZeRO-Offload's optimizer) is JIT-built on first use (minutes).
Each optimizer steps one flat fp32 parameter with an fp32 gradient, the layout ZeRO-Offload
hands it (a partition of the flat master weights); the first step (state allocation) is not timed.
"""

from __future__ import annotations

import argparse
import time

import torch


def rate(make, numel: int, steps: int) -> float:
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel) * 1e-3
    opt = make([param])
    opt.step()
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return numel * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=20_000_000)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cases = {
        "DeepSpeedCPUAdam (adamw_mode)": lambda p: DeepSpeedCPUAdam(p, lr=1e-4, weight_decay=0.01, adamw_mode=True),
        "torch AdamW foreach=False": lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01, foreach=False),
        "torch AdamW foreach=True": lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01, foreach=True),
        "torch AdamW fused=True (the trainer's)": lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01, fused=True),
    }
    print("| optimizer | threads | parameters | steps | parameters/s |\n|---|---:|---:|---:|---:|")
    for name, make in cases.items():
        r = rate(make, args.numel, args.steps)
        print(f"| {name} | {torch.get_num_threads()} | {args.numel:,} | {args.steps} | {r / 1e6:,.1f} M |", flush=True)


if __name__ == "__main__":
    main()
