"""Two parts of a training step timed alone: the loss and the optimizer step, harness's against torch's.

    OMP_NUM_THREADS=2 python benchmarks/step_parts.py [--rows 512] [--vocab 49152] [--repeats 7]

- loss: forward + backward of harness's fused fp32 cross-entropy (``harness.training.loss``, the
  unchunked path the trainer takes by default) against ``torch.nn.functional.cross_entropy`` on
  ``rows x vocab`` logits (default: SmolLM2-135M's vocabulary, micro-batch 2 x 256 tokens), fp32
  and bf16 logits; median of ``--repeats``; the two losses and the largest gradient difference.
- optimizer: one step of torch AdamW as harness builds it (``harness.training.build_optimizer``:
  fused) against the single-tensor loop (``foreach=False``) over tensors of SmolLM2-135M's shapes
  (the tied embedding, 30 layers of attention and MLP matrices, the norms), fp32 with gradients;
  the second of two steps, best of ``--repeats``.
"""

from __future__ import annotations

import argparse
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


def optimizer_rows(repeats: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SMOLLM2_SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    numel = sum(p.numel() for p in params)

    def second_step(make: Callable[[], torch.optim.Optimizer]) -> float:
        best = float("inf")
        for _ in range(repeats):
            opt = make()
            opt.step()
            start = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    harness = second_step(lambda: build_optimizer(params, OptimConfig(lr=1e-5)))
    single = second_step(lambda: torch.optim.AdamW(params, lr=1e-5, foreach=False))
    shape = f"{len(params)} tensors, {numel:,} parameters, fp32"
    return [f"| AdamW step | {shape} | {harness:.1f} ms (fused) | {single:.1f} ms (foreach=False) | |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"| part | shape | harness | torch | check |  (threads: {torch.get_num_threads()})")
    print("|---|---|---:|---:|---|")
    for line in loss_rows(args.rows, args.vocab, args.repeats) + optimizer_rows(min(args.repeats, 3)):
        print(line, flush=True)


if __name__ == "__main__":
    main()
