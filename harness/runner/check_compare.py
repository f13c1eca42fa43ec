"""What the check for silent wrong results compares, and within what bound.

Each rank records, per step, its part of every parameter's reduced gradient (before the
optimizer step) and of its weights (after it), as `ParamShard`s give them; the reference
holds the whole tensors. Each rank compares its ranges against the same ranges of the
reference, and the sums are gathered, so no rank ever holds another's shards. A quantity
differs when its relative error, ||run - reference|| / ||reference||, exceeds the bound of
the run's precision:

- `grad_bound(compute, tokens, layers)`: two correct computations of the same step differ only by
  rounding. The reference is the exact recipe in fp32 at world 1 (one micro-batch, no
  sharding, no packing); the run adds (a) summation in another order (micro-batches, ranks,
  shards): a sum of n terms computed in two orders differs by about sqrt(n)*u32 relative to
  the sum of the terms' magnitudes (Higham & Mary 2019's probabilistic bound), and a gradient
  is a sum over the step's n tokens of terms of either sign, whose magnitudes add up to about
  sqrt(n) times the sum itself: n*u32 relative to the gradient, scaled by `LAMBDA` = 6, whose
  tail probability for one quantity is below 1e-7 (2*exp(-lambda^2/2)); and (b) a rounding of
  relative size u (the compute dtype's unit roundoff; fp32 too: other batch shapes, other
  kernels) at each of the m stored tensors along a gradient's path, forward and backward. These
  are not independent (the same rounded weights and activations serve forward and backward),
  so they add in the worst case: m*u (Higham's gamma_m). Measured on the correct runs of
  `notes/reliability.md`: bf16 runs reach 0.14 of the 0.20 this gives for the 2-layer twin.
- `update_bound(grad_bound)`: Adam divides each gradient element by its own magnitude, which
  damps relative errors (d/dg g/(|g|+eps) <= 1/(|g|+eps)) except for elements whose gradient is
  within the error of zero, whose update may flip sign (2*lr). Their share of a tensor grows
  with the relative error e, so their share of the update's norm with sqrt(e):
  bound 2*sqrt(e) (at most 1).
- the loss: the gradient's bound (it is one more sum over the step's tokens).

`notes/reliability.md` lists the bounds and what correct runs and the four planted bugs measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

LAMBDA = 6.0
STAGES_PER_BLOCK = 12  # stored tensors a gradient passes per decoder block: 2 norms, q/k/v/o, scores, softmax, gate/up/down, residual
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def grad_bound(compute: torch.dtype, tokens: int, layers: int) -> float:
    """The relative error two correct computations of a step's gradient may differ by (module docstring)."""
    order = LAMBDA * max(tokens, 1) * UNIT_ROUNDOFF[torch.float32]
    stages = 2 * (layers * STAGES_PER_BLOCK + 2)  # forward and backward, plus embedding and head
    return order + stages * UNIT_ROUNDOFF[compute]


def update_bound(grad: float) -> float:
    return min(1.0, 2.0 * math.sqrt(grad))


@dataclass
class Part:
    """One parameter's flat range on this rank: the run's values and the reference's, as fp32 on the CPU."""

    name: str
    start: int
    end: int
    values: torch.Tensor | None  # None: the run has no gradient for it


def sums(parts: list[Part], reference: dict[str, torch.Tensor | None]) -> dict[str, list[float]]:
    """Per parameter: [squared difference, squared reference, largest |difference|, its flat index,
    elements, whether the run lacks a value the reference has] over this rank's ranges."""
    out: dict[str, list[float]] = {}
    for part in parts:
        ref = reference.get(part.name)
        if ref is None and part.values is None:
            continue
        ref_part = ref.reshape(-1)[part.start : part.end] if ref is not None else torch.zeros(part.end - part.start)
        run = part.values if part.values is not None else torch.zeros_like(ref_part)
        diff = (run - ref_part).abs()
        worst = int(diff.argmax()) if diff.numel() else 0
        missing = float(part.values is None and ref is not None and bool(ref_part.ne(0).any()))
        mine = [float(diff.square().sum()), float(ref_part.square().sum()), float(diff.max()) if diff.numel() else 0.0]
        total = out.setdefault(part.name, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        if mine[2] > total[2]:
            total[2], total[3] = mine[2], float(part.start + worst)
        total[0] += mine[0]
        total[1] += mine[1]
        total[4] += diff.numel()
        total[5] = max(total[5], missing)
    return out


def merge(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """The ranks' sums added (the largest difference kept with its index)."""
    out: dict[str, list[float]] = {}
    for rank_sums in per_rank:
        for name, s in rank_sums.items():
            total = out.setdefault(name, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            if s[2] > total[2]:
                total[2], total[3] = s[2], s[3]
            total[0] += s[0]
            total[1] += s[1]
            total[4] += s[4]
            total[5] = max(total[5], s[5])
    return out


@dataclass
class Finding:
    """The first quantity that differs beyond its bound."""

    step: int
    what: str  # "loss" | "gradient" | "update" | "initial weights"
    name: str
    relative: float
    bound: float
    detail: str = ""

    def line(self) -> str:
        return (
            f"step {self.step} {self.what} of {self.name} differs from the world-1 reference: relative error "
            f"{self.relative:.3g} > bound {self.bound:.3g}{self.detail}"
        )


@dataclass
class Verdict:
    """Everything compared, in order, and the first difference (None: the run computes what the reference does)."""

    first: Finding | None = None
    worst: dict[str, tuple[float, str]] = field(default_factory=dict)  # quantity -> largest relative error seen, and where
    compared: int = 0

    def summary(self) -> str:
        return "; ".join(f"{key} {rel:.2g} ({name})" for key, (rel, name) in self.worst.items())

    def add(self, step: int, what: str, name: str, relative: float, bound: float, detail: str = "") -> None:
        self.compared += 1
        key = f"{what} (bound {bound:.2g})"
        if relative >= self.worst.get(key, (-1.0, ""))[0]:
            self.worst[key] = (relative, name)
        if relative > bound and self.first is None:
            self.first = Finding(step, what, name, relative, bound, detail)


def judge(verdict: Verdict, step: int, what: str, totals: dict[str, list[float]], order: list[str], bound: float, shape: dict) -> None:
    """Add each parameter's relative error (in model order) to `verdict`; `order`: every parameter
    the reference has a value for, so one the run lacks (by name) is a difference, never skipped."""
    for name in order:
        if name not in totals:
            verdict.add(step, what, name, math.inf, bound, " (no rank of the run has a parameter of that name)")
            continue
        sq_diff, sq_ref, largest, index, _, missing = totals[name]
        relative = math.sqrt(sq_diff) / math.sqrt(sq_ref) if sq_ref > 0 else (0.0 if sq_diff == 0 else math.inf)
        where = unravel(int(index), shape.get(name, ()))
        detail = (
            f" (largest |difference| {largest:.3g} at {name}{list(where)}" + ("; the run has no gradient for it" if missing else "") + ")"
        )
        verdict.add(step, what, name, relative, bound, detail)


def unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(shape):
        out.append(index % d)
        index //= d
    return tuple(reversed(out))


__all__ = ["Finding", "Part", "Verdict", "grad_bound", "judge", "merge", "sums", "update_bound"]
