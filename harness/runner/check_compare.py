"""What the check for silent wrong results compares, and within what bound.

Each rank records, per step, its part of every parameter's reduced gradient (before the
optimizer step) and of its weights (after it), as `ParamShard`s give them; the reference
holds the whole tensors. Each rank compares its ranges against the same ranges of the
reference, and the sums are gathered, so no rank ever holds another's shards. A quantity
differs when its relative error, ||run - reference|| / ||reference||, exceeds the bound of
the run's precision:

- `grad_bound(compute, tokens, layers, width)`: two correct computations of the same step differ
  only by rounding. The reference is the exact recipe in fp32 at world 1 (one micro-batch, no
  sharding, no packing); the run differs from it in three ways, added in the worst case (they are
  not independent: the same rounded weights and activations serve forward and backward):
  (a) rounding: each of the m stored tensors along a gradient's path, forward and backward, is
  rounded to the compute dtype, relative size u (its unit roundoff): m*u (Higham's gamma_m);
  (b) other kernels: each of those m stages is computed by kernels of other shapes (batch,
  sharding), which sum their dot products of up to `width` terms (the hidden or MLP width, or the
  sequence in attention) in another order: sqrt(width)*u32 each (Higham & Mary 2019's
  probabilistic bound), `LAMBDA` = 6 for a tail probability below 1e-7 (2*exp(-lambda^2/2)):
  m*LAMBDA*sqrt(width)*u32; (c) the token sum: a gradient is a sum over the step's n tokens,
  split over micro-batches, ranks and shards; each addition rounds relative to the running sum,
  which is of the size of the gradient itself whether its terms are signal or noise, so two orders
  differ by LAMBDA*sqrt(n)*u32 relative to the gradient. (Until 2026-12-02 this was n*u32: the
  bound relative to the sum of the terms' magnitudes, counted again as sqrt(n) times the sum; it
  grew past every planted bug's error at a few million tokens.) Measured on the correct runs of
  `notes/reliability.md` (first step, 512 / 131,072 tokens, on CPU): fp32 1.7e-07 / 1.3e-06 of
  2.6e-04 / 3.8e-04 (the kernel term is most of it: an allowance for a GPU's shape-dependent
  kernels, unmeasured); bf16 0.010 / 0.185 of 0.20, the latter the tied embedding, whose error
  grows with the step where the blocks' stays near 0.01 (bf16's rounding of the weights every token
  shares does not average out, while the gradient's token noise does): the margin left at 131,072.
- `update_bound(grad_bound)`: Adam divides each gradient element by its own magnitude, which
  damps relative errors (d/dg g/(|g|+eps) <= 1/(|g|+eps)) except for elements whose gradient is
  within the error of zero, whose update may flip sign (2*lr). Their share of a tensor grows
  with the relative error e, so their share of the update's norm with sqrt(e):
  bound 2*sqrt(e) (at most 1).
- `DETECTION_LIMIT`: the planted bugs' errors (`notes/reliability.md`) are 0.25 and up (a packing
  leak 0.25-0.30; gradients never reduced, or not divided by the accumulation, about 1), and a
  parameter never updated has an update error of exactly 1, which the update bound reaches at a
  gradient bound of 0.25. A step whose gradient bound would reach it (bf16 past ~1.7e10 tokens) is
  refused before the check runs, never passed (`check_bounds`).
- `rounding_bounds`: in bf16 the worst case above is loose (it adds every stage's rounding as if
  none cancelled) where the planted bugs need not be: a plain DDP run that never all-reduces differs
  by 0.075 at 131,072 tokens, inside bf16's worst case (0.20), while a correct run's rounding is near
  0.01. So a bf16 run's first-step gradients are bounded by what rounding measurably does: a second
  world-1 reference computed in bf16 (`harness.runner.check.rounding_reference_config`), whose
  relative difference e from the fp32 reference is, per parameter, what bf16 alone does to that
  gradient. The run rounds in other places than that reference (other kernels' orders, each data
  rank's partial gradient, the reduction, the final cast), each one rounding of relative size u
  at most: the bound is min(worst case, fp32's own terms + `ROUNDING_MARGIN` * e + (2 + data ranks) * u).
  Measured (`notes/reliability.md`): a correct FSDP2 bf16 run 0.0082 of 0.041 at 131,072 tokens,
  the never-reduced DDP run named there. Updates and the second step keep the worst case: the bf16
  reference steps bf16 weights with no fp32 master, so it does not make the run's Adam sign flips.
- the loss: the gradient's bound (it is one more sum over the step's tokens).
- from the second step on, `drift_allowance`: the run starts the step from its own weights, which
  left the reference's by the previous update's error e (its relative error over all parameters,
  measured: in bf16 Adam's sign flips make it 0.09 where fp32's is 2e-05). A gradient moves with
  the weights: between the reference's own steps by c = ||g_s - g_{s-1}|| / ||g_s|| for a weight
  change of one whole update, so by about e*c for the run's; `DRIFT` = 3 times that is added to
  the parameter's bound (measured: at most 1.73 times, the tied embedding at 131,072 tokens in
  bf16). The first step, from the same weights, is the fine comparison: every planted bug is
  named there.

`notes/reliability.md` lists the bounds and what correct runs and the four planted bugs measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from harness.training import PrecisionPolicy

LAMBDA = 6.0
STAGES_PER_BLOCK = 12  # stored tensors a gradient passes per decoder block: 2 norms, q/k/v/o, scores, softmax, gate/up/down, residual
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


DETECTION_LIMIT = 0.25  # the smallest planted bug's error; the update bound reaches 1 here (module docstring)
DRIFT = 3.0  # the allowance for weights that left the reference's, in multiples of its estimate (module docstring)
ROUNDING_MARGIN = 3.0  # the measured rounding's multiple in a bf16 run's first-step bound (module docstring)


def grad_bound(compute: torch.dtype, tokens: int, layers: int, width: int) -> float:
    """The relative error two correct computations of a step's gradient may differ by (module docstring):
    `tokens` the step's (every data-parallel rank's), `width` the longest dot product inside a stage."""
    u32 = UNIT_ROUNDOFF[torch.float32]
    stages = 2 * (layers * STAGES_PER_BLOCK + 2)  # forward and backward, plus embedding and head
    rounding = stages * UNIT_ROUNDOFF[compute]
    kernels = stages * LAMBDA * math.sqrt(max(width, 1)) * u32
    order = LAMBDA * math.sqrt(max(tokens, 1)) * u32
    return rounding + kernels + order


def relative_errors(values: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Per parameter both hold a value for, ||values - reference|| / ||reference|| (inf where the
    reference is zero and the values are not)."""
    out = {}
    for name, ref in reference.items():
        other = values.get(name)
        if ref is None or other is None:
            continue
        diff, norm = float((other.float() - ref.float()).norm()), float(ref.float().norm())
        out[name] = diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)
    return out


def rounding_bounds(measured: list[dict[str, float]], worst_case: float, floor: float, unit: float, data_ranks: int) -> dict[str, float]:
    """Each parameter's first-step gradient bound from the rounding measured in the run's precision
    (module docstring): `measured` every rank's relative errors (the largest taken, so every rank
    holds the same bounds), `floor` the fp32 bound of the same step, `unit` the compute dtype's
    unit roundoff; never above `worst_case`."""
    largest: dict[str, float] = {}
    for errors in measured:
        for name, e in errors.items():
            largest[name] = max(largest.get(name, 0.0), e)
    slack = (2 + data_ranks) * unit
    return {name: min(worst_case, floor + ROUNDING_MARGIN * e + slack) for name, e in largest.items()}


def update_bound(grad: float) -> float:
    return min(1.0, 2.0 * math.sqrt(grad))


def drift_allowance(drift: float, now: dict[str, torch.Tensor | None], before: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Per parameter, what its gradient may differ by because the run's weights left the reference's by
    the previous update's relative error `drift` (module docstring): `DRIFT` * drift * c, with c the
    reference's own change of that gradient between the two steps (`now`, `before`: its gradients)."""
    out = {}
    for name, g in now.items():
        prior = before.get(name)
        if g is not None and prior is not None and float(g.norm()) > 0:
            out[name] = DRIFT * drift * float((g - prior).norm() / g.norm())
    return out


def overall(totals: dict[str, list[float]]) -> float:
    """The relative error of all parameters together (their squared sums added)."""
    sq_ref = sum(t[1] for t in totals.values())
    return math.sqrt(sum(t[0] for t in totals.values()) / sq_ref) if sq_ref > 0 else 0.0


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
    worst: dict[str, tuple[float, str, float]] = field(default_factory=dict)  # quantity -> largest relative error, where, its bound
    compared: int = 0
    closest: tuple[str, float, float] | None = None  # the quantity nearest its bound (relative to it): what, error, bound

    def summary(self) -> str:
        worst = "; ".join(f"{key} {rel:.2g} ({name}, bound {bound:.2g})" for key, (rel, name, bound) in self.worst.items())
        if self.closest is None:
            return worst
        what, rel, bound = self.closest
        return f"{worst}; nearest its bound: {what} {rel:.2g} of {bound:.2g}"

    def add(self, step: int, what: str, name: str, relative: float, bound: float, detail: str = "") -> None:
        self.compared += 1
        key = what if what in ("initial weights", "loss") else f"step {step} {what}"
        if relative >= self.worst.get(key, (-1.0, "", 0.0))[0]:
            self.worst[key] = (relative, name, bound)
        if bound > 0 and (self.closest is None or relative / bound > self.closest[1] / self.closest[2]):
            self.closest = (key if what in ("loss", "aux loss") else f"{key} of {name}", relative, bound)
        if relative > bound and self.first is None:
            self.first = Finding(step, what, name, relative, bound, detail)


def judge(
    verdict: Verdict, step: int, what: str, totals: dict[str, list[float]], order: list[str], bounds: float | dict[str, float], shape: dict
) -> None:
    """Add each parameter's relative error (in model order) to `verdict`; `order`: every parameter
    the reference has a value for, so one the run lacks (by name) is a difference, never skipped;
    `bounds`: one for all, or each parameter's."""
    for name in order:
        bound = bounds[name] if isinstance(bounds, dict) else bounds
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


def failure_hint(precision: PrecisionPolicy, first: Finding) -> str | None:
    """What a bf16 run's failed check most likely saw, when its first difference is within twice its
    bound (None: nothing to add). Two causes are the precision's own, not a bug in the run: an
    update rounded away by weights kept in bf16 (the reference steps fp32 weights, so its small
    updates land; a norm weight near 1 moves by the learning rate, far below bf16's step of 2^-7
    there), and a rounding neither reference saw at a large step (a kernel's own order, the run's
    reductions)."""
    if precision.compute_dtype != torch.bfloat16 or first.relative >= 2 * first.bound:
        return None
    if first.what == "update" and precision.param_dtype == torch.bfloat16:
        return (
            f"check: this run keeps {precision.master_weights}: an update smaller than half a bf16 step of its weight "
            "rounds away, where the fp32 reference's lands; strategy=fsdp keeps fp32 master weights (at any world size), "
            "or precision=fp32 trains in fp32 throughout"
        )
    return (
        "check: in bf16 an error this close to its bound may be bf16's own rounding at a large step; "
        "precision=fp32 compares a thousand times finer: a difference that remains there is the run's"
    )


def unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(shape):
        out.append(index % d)
        index //= d
    return tuple(reversed(out))


__all__ = [
    "DETECTION_LIMIT",
    "DRIFT",
    "ROUNDING_MARGIN",
    "Finding",
    "Part",
    "Verdict",
    "drift_allowance",
    "failure_hint",
    "grad_bound",
    "judge",
    "merge",
    "overall",
    "relative_errors",
    "rounding_bounds",
    "sums",
    "update_bound",
]
