"""`prune.method=sparsegpt_fit`: SparseGPT block by block, then each block's surviving weights
fitted to the dense block's outputs by a few gradient steps through that block alone. No
gradient chooses a mask: the masks are SparseGPT's; the fit moves the weights it kept.

Why: SparseGPT's update is per matrix (OBS on each Linear's own input Hessian). The block's error
||block(X) - Y||^2 couples its matrices through attention and the MLP's gate; its gradient (a
backward through one block, reduced across ranks like any gradient) moves the surviving weights
of every matrix of the block at once.

Per block (`harness.pruning.blockwise` streams them):
  1. X: the block's inputs from the pruned blocks below; Y = dense block(X), with each Linear's
     input Hessian hooked in.
  2. masks and OBS-updated weights per matrix (`baselines.obs_prune`, on this rank's rows).
  3. `fit_epochs` epochs of Adam on the masked block against Y, one Adam step per step of the
     runner's `grad_accum` micro-batches per rank, over all but the held-out steps; the update
     element-wise on this rank's shard, pruned entries held at exactly zero.
  4. The guard: the block's error on the held-out calibration steps with the fitted weights
     must not exceed the error with SparseGPT's weights alone after the last step (nor 1.5x it
     after the first: a step size that diverges is given up at the cost of one step). Otherwise
     the fit is undone and tried once more at a tenth of the step size; if that fails too,
     SparseGPT's weights stay. A divergent fit is caught here and never exported. The report says,
     per block, which weights were kept.
Memory above the model: one block's calibration inputs and targets, its Hessians (as SparseGPT),
Adam's two fp32 moments and a copy of SparseGPT's weights for the block's local shard.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from harness.distributed import Collectives
from harness.models import decoder_blocks
from harness.pruning.baselines import obs_prune
from harness.pruning.blockwise import Block, stream_blocks
from harness.pruning.calibration import Ledger, Runner
from harness.pruning.masks import MaskSet
from harness.pruning.method_run import MethodRun
from harness.pruning.shards import ShardView, restore_views, snapshot_views, sync_views

# Step sizes tried in turn, as multiples of `prune.fit_lr`: a fit the guard rejects is retried
# once at a tenth (a divergent step size is the usual cause), then SparseGPT's weights stay.
LR_TRIES = (1.0, 0.1)
HOLDOUT_SHARE = 8  # one step in this many (at least one) is held out for the guard
# A step size whose first step leaves the held-out error above this many times SparseGPT's is
# given up at once (a divergent step size shows there; a good one may still start a little worse:
# on Gemma-3-270M lr 1e-4 began up to 1.03x above and ended below SparseGPT's error).
DIVERGED = 1.5


@dataclass(frozen=True)
class FitOutcome:
    """What the guard decided for one block (the report's `fit` rows)."""

    block: int
    kept: str  # "fit" or "sparsegpt"
    lr: float | None  # the accepted step size (None: SparseGPT's weights kept)
    error_sparsegpt: float  # held-out error with SparseGPT's weights, relative to the targets' energy
    error_fit: float  # held-out error of the last fit tried (the accepted one, if any)
    held_out: bool  # False: too few steps to hold one out; the guard read the fit's own steps


class MaskedAdam:
    """Adam on this rank's shard of each view; pruned entries stay exactly zero."""

    def __init__(self, views: list[ShardView], masks: dict[str, torch.Tensor], lr: float, ledger: Ledger) -> None:
        self.views, self.masks, self.lr, self.t = views, masks, lr, 0
        self.m = {v.name: torch.zeros(v.local_numel, dtype=torch.float32, device=v.lp().device) for v in views}
        self.v = {v.name: torch.zeros_like(self.m[v.name]) for v in views}
        for v in views:
            ledger.add(f"fit/adam/{v.name}", 2 * v.local_numel * 4)

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        """One Adam step (bias-corrected, no weight decay), in place where it can be: a block's
        shard is millions of weights, and each temporary a pass over them."""
        self.t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        for view in self.views:
            g, m, v = grads[view.name], self.m[view.name], self.v[view.name]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = v.sqrt().div_(math.sqrt(1 - b2**self.t)).add_(eps)  # sqrt of the bias-corrected v, + eps
            new = view.weight().addcdiv_(m, denom, value=-self.lr / (1 - b1**self.t)).masked_fill_(self.masks[view.name], 0.0)
            view.write(slice(None), new, master=True)


Item = tuple[torch.Tensor, Any, torch.Tensor]  # (block input, its call, dense output), one micro-batch


def _step_gradients(runner: Runner, block: Block, items: list[Item], scale: float, comm: Collectives) -> dict[str, torch.Tensor]:
    """This rank's range of the gradient of one step's block error, summed over the step's
    micro-batches of every rank and divided by their count (what a probe step's reduced gradient
    is, `Runner`).

    Wherever the forward sees whole weight tensors (one process, DDP, ZeRO-1/2, and ZeRO-3, which
    gathers a block's weights for its forward and backward) the targets' gradients are asked of
    autograd alone and reduced here, one block's worth of full gradients at a time: the arithmetic
    is then the same at every world size, and no engine hook runs outside the engine's own step.
    FSDP2's forward runs on unsharded copies of its DTensor parameters, so there the backward runs
    and FSDP2's reduce-scatter (an average over ranks) delivers the range."""
    assert block.module is not None
    views = block.views
    params = [v.param for v in views]
    n = len(items)
    share = 1.0 / len(decoder_blocks(runner.module))  # a block's fwd+bwd: this share of a model pass

    def loss_of(x: torch.Tensor, call: Any, y: torch.Tensor) -> torch.Tensor:
        return (call(block.module, x) - y).float().pow(2).sum() / scale

    if not runner.probe.forward_sees_whole(params):
        for x, call, y in items:
            (loss_of(x, call, y) / n).backward()
            runner.fwd_bwd_batches += share
        grads = {v.name: v.grad().clone() for v in views}
        runner.zero_grad()
        return grads
    acc: list[torch.Tensor] | None = None
    for x, call, y in items:
        gs = torch.autograd.grad(loss_of(x, call, y) / n, params)
        acc = [g.detach().float() for g in gs] if acc is None else [a.add_(g) for a, g in zip(acc, gs)]
        runner.fwd_bwd_batches += share
    assert acc is not None
    if comm.distributed:
        acc = [comm.all_reduce_sum(g.div_(comm.world)) for g in acc]
    return {v.name: g.reshape(-1)[v.start : v.end].clone() for v, g in zip(views, acc)}


def _error(block: Block, items: list[Item], scale: float, comm: Collectives) -> float:
    """The block's squared error on `items` over every rank, relative to `scale` (collective)."""
    assert block.module is not None
    with torch.no_grad():
        local = sum(float((call(block.module, x) - y).float().pow(2).sum()) for x, call, y in items)
    total = comm.all_reduce_sum(torch.tensor([local], dtype=torch.float64, device=comm.device))
    return float(total.item()) / scale


def _split(items: list[Item], accum: int) -> tuple[list[Item], list[Item]]:
    """(the fit's items, the guard's): the last of every `HOLDOUT_SHARE` steps of `accum`
    micro-batches held out, at least one; a single step is both (nothing left to hold out).
    Steps are the same global micro-batches at every world size x accumulation (`shard_calibration`)."""
    steps = len(items) // accum
    if steps < 2:
        return items, items
    held = max(1, steps // HOLDOUT_SHARE)
    cut = (steps - held) * accum
    return items[:cut], items[cut:]


def fit_block(
    runner: Runner, block: Block, masks: dict[str, torch.Tensor], epochs: int, lr: float, comm: Collectives, ledger: Ledger
) -> FitOutcome:
    """Fit the block's surviving weights (SparseGPT's, as written) to its dense outputs, guarded
    (module docstring). Collective: every rank reaches the same verdict from all-reduced errors."""
    assert block.outputs is not None
    items = [(x, call, y) for x, call, y in zip(block.inputs, block.calls, block.outputs)]
    energy = torch.tensor([sum(float(y.float().pow(2).sum()) for y in block.outputs)], dtype=torch.float64)
    scale = float(comm.all_reduce_sum(energy.to(comm.device)).item()) / max(1, len(items) * comm.world) or 1.0
    fit_items, held = _split(items, runner.accum)
    obs_weights = snapshot_views(block.views)
    ledger.add(
        "fit/sparsegpt_weights",
        sum(a.numel() * a.element_size() + (0 if m is None else m.numel() * m.element_size()) for a, m in obs_weights),
    )
    per_item = scale * max(1, len(held) * comm.world)  # errors relative to the held-out targets' mean energy
    base = _error(block, held, per_item, comm)

    def fitted(step_size: float) -> float:
        """The held-out error after the fit at `step_size`; given up after the first step if that
        step already leaves the error `DIVERGED` times SparseGPT's (a step size too large)."""
        opt = MaskedAdam(block.views, masks, step_size, ledger)
        for epoch in range(epochs):
            for i in range(0, len(fit_items), runner.accum):
                runner._check_stop()
                opt.step(_step_gradients(runner, block, fit_items[i : i + runner.accum], scale, comm))
                sync_views(block.views, comm)
                if epoch == 0 and i == 0:
                    first = _error(block, held, per_item, comm)
                    if not first <= DIVERGED * base:  # NaN included
                        return first
        return _error(block, held, per_item, comm)

    tried = math.nan
    try:
        for factor in LR_TRIES:
            tried = fitted(lr * factor)
            ledger.drop("fit/adam/")
            if math.isfinite(tried) and tried <= base:
                return FitOutcome(block.index, "fit", lr * factor, base, tried, held is not items)
            restore_views(block.views, obs_weights, comm)
        return FitOutcome(block.index, "sparsegpt", None, base, tried, held is not items)
    finally:
        ledger.drop("fit/")


def run(r: MethodRun) -> MaskSet:
    """The registry's entry: SparseGPT streamed block by block, each block fitted and guarded;
    the guard's verdicts go to the report (`r.details["fit"]`)."""
    views = [v for group in r.groups for v in group]
    outcomes: list[FitOutcome] = []

    def prune(block: Block) -> dict[str, torch.Tensor]:
        if block.module is None:
            raise ValueError(f"prune.method=sparsegpt_fit fits decoder blocks only; {block.views[0].name} is outside them")
        masks = obs_prune(block.views, block.stats, r.rule, r.allocation, r.forced, r.comm, r.ledger)
        if r.cfg.fit_epochs:
            outcomes.append(fit_block(r.runner, block, masks, r.cfg.fit_epochs, r.cfg.fit_lr, r.comm, r.ledger))
        return masks

    masks = stream_blocks(r.runner, r.batches, views, r.comm, r.ledger, prune, hessian=True, keep_outputs=r.cfg.fit_epochs > 0)
    r.details["fit"] = [asdict(o) for o in outcomes]
    return MaskSet(masks)
