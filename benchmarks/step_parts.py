"""Parts of a training step timed alone: the loss and the optimizer step, harness's against torch's,
and the host Adam rate (DeepSpeed's CPU Adam against torch's AdamW).

    OMP_NUM_THREADS=2 python benchmarks/step_parts.py [--rows 512] [--vocab 49152] [--repeats 7]
    OMP_NUM_THREADS=2 python benchmarks/step_parts.py --parts optimizer --optimizers adamw adamw_bf16 adamw_8bit adamw_4bit paged_adamw_8bit
    OMP_NUM_THREADS=1 python benchmarks/step_parts.py --parts host-adam --numel 20000000 --steps 5

- loss: forward + backward of harness's fused fp32 cross-entropy (``harness.training.loss``, the
  unchunked path the trainer takes by default) against ``torch.nn.functional.cross_entropy`` on
  ``rows x vocab`` logits (default: SmolLM2-135M's vocabulary, micro-batch 2 x 256 tokens), fp32
  and bf16 logits; median of ``--repeats``; the two losses and the largest gradient difference.
- optimizer: one step of each ``--optimizers`` name as harness builds it
  (``harness.training.build_optimizer``; AdamW: fused) against torch's single-tensor loop
  (``foreach=False``) over tensors of SmolLM2-135M's shapes (the tied embedding, 30 layers of
  attention and MLP matrices, the norms), fp32 with gradients. Per optimizer, fresh optimizers (at
  most 3 of ``--repeats``), each timed at the step after ``--warmup`` (torchao compiles its
  per-tensor step on the first: the "first step" column); the best of them. Only the optimizer step
  differs between the runs of benchmarks/optim_quality.py.
- host-adam: parameters stepped per second on one flat fp32 parameter with an fp32 gradient, the
  layout ZeRO-Offload hands DeepSpeed's op (a partition of the flat master weights), the first step
  untimed: ``DeepSpeedCPUAdam`` (JIT-built on first use: minutes) against torch's AdamW. This is the
  rate of the machine it runs on, which ``harness.plan --cpu-adam-rate`` takes for the offload
  rungs' step time (``harness.planner.ladder``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from harness.config import OptimConfig
from harness.training import build_optimizer, ce_sum

# SmolLM2-135M: embedding 49152 x 576 (tied), per layer q/o 576x576, k/v 192x576, gate/up/down
# 576x1536, two norms; 30 layers and the final norm.
LAYER = [(576, 576), (576, 576), (192, 576), (192, 576), (1536, 576), (1536, 576), (576, 1536), (576,), (576,)]
SMOLLM2_SHAPES = [(49152, 576)] + LAYER * 30 + [(576,)]


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def loss_rows(rows: int, vocab: int, repeats: int) -> list[str]:
    out = []
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)

        def ours() -> tuple[torch.Tensor, torch.Tensor]:
            x = logits.clone().requires_grad_(True)
            loss = ce_sum(x, targets, 1.0 / rows)
            loss.backward()
            return loss.detach(), x.grad.float()

        def torchs() -> tuple[torch.Tensor, torch.Tensor]:
            x = logits.clone().float().requires_grad_(True)
            loss = F.cross_entropy(x, targets, reduction="sum") / rows
            loss.backward()
            return loss.detach(), x.grad

        (a, ga), (b, gb) = ours(), torchs()
        clone = median_ms(lambda: logits.clone(), repeats)  # both include one copy of the logits
        t_ours, t_torch = median_ms(ours, repeats) - clone, median_ms(torchs, repeats) - clone
        out.append(
            f"| loss | {str(dtype).removeprefix('torch.')} logits {rows}x{vocab} | {t_ours:.1f} ms | {t_torch:.1f} ms | "
            f"loss {float(a):.6f} vs {float(b):.6f}, gradient max diff {float((ga - gb).abs().max()):.2e} |"
        )
    return out


def optimizer_rows(names: list[str], repeats: int, warmup: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SMOLLM2_SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    shape = f"{len(params)} tensors, {sum(p.numel() for p in params):,} parameters, fp32"

    def timed(make: Callable[[], torch.optim.Optimizer]) -> tuple[float, float]:
        """(median first step s, best step ms after the warm-up) over fresh optimizers."""
        first, best = [], float("inf")
        for _ in range(repeats):
            opt = make()
            for i in range(warmup + 1):
                start = time.perf_counter()
                opt.step()
                took = time.perf_counter() - start
                if i == 0:
                    first.append(took)
            best = min(best, took)
            del opt
            gc.collect()
        return statistics.median(first), best * 1e3

    single = timed(lambda: torch.optim.AdamW(params, lr=1e-5, foreach=False))[1]
    rows = []
    for name in names:
        first, ms = timed(lambda name=name: build_optimizer(params, OptimConfig(name=name, lr=1e-5)))
        ours = f"| AdamW step | {shape} | {ms:.1f} ms (fused)" if name == "adamw" else f"| `{name}` step | {shape} | {ms:.1f} ms"
        rows.append(f"{ours} | {single:.1f} ms (foreach=False) | first step {first:.2f} s |")
    return rows


def host_adam_rows(numel: int, steps: int) -> list[str]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cases = {
        "DeepSpeedCPUAdam (adamw_mode)": lambda p: DeepSpeedCPUAdam(p, lr=1e-4, weight_decay=0.01, adamw_mode=True),
        "torch AdamW foreach=False": lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01, foreach=False),
        "torch AdamW foreach=True": lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01, foreach=True),
        "torch AdamW fused=True (the trainer's)": lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01, fused=True),
    }
    rows = []
    for name, make in cases.items():
        param = torch.nn.Parameter(torch.randn(numel))
        param.grad = torch.randn(numel) * 1e-3
        opt = make([param])
        opt.step()
        start = time.perf_counter()
        for _ in range(steps):
            opt.step()
        rate = numel * steps / (time.perf_counter() - start)
        rows.append(f"| {name} | {torch.get_num_threads()} | {numel:,} | {steps} | {rate / 1e6:,.1f} M |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=("loss", "optimizer", "host-adam"), default=["loss", "optimizer"])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--optimizers", nargs="+", default=["adamw"], help="optim.name values for the optimizer rows")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps before the timed one")
    parser.add_argument("--numel", type=int, default=20_000_000, help="host-adam: the flat parameter's elements")
    parser.add_argument("--steps", type=int, default=5, help="host-adam: timed steps")
    args = parser.parse_args()
    if {"loss", "optimizer"} & set(args.parts):
        print(f"| part | shape | harness | torch | check |  (threads: {torch.get_num_threads()})")
        print("|---|---|---:|---:|---|")
        if "loss" in args.parts:
            print("\n".join(loss_rows(args.rows, args.vocab, args.repeats)), flush=True)
        if "optimizer" in args.parts:
            print("\n".join(optimizer_rows(args.optimizers, min(args.repeats, 3), args.warmup)), flush=True)
    if "host-adam" in args.parts:
        print("| optimizer | threads | parameters | steps | parameters/s |\n|---|---:|---:|---:|---:|")
        print("\n".join(host_adam_rows(args.numel, args.steps)), flush=True)


if __name__ == "__main__":
    main()
