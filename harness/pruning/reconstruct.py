"""GradProbe's reconstruct mode: each decoder block is pruned on the inputs the already-pruned
blocks below it produce, then its surviving weights are fitted back to the dense block's
outputs by a few gradient steps through that block alone.

Why: on SmolLM2-135M every score-only rule loses to SparseGPT by a wide margin at 2:4 and at
60-70% (notes/pruning.md); what SparseGPT has and they lack is a weight update after the mask.
The update here goes one level further than SparseGPT's per-matrix OBS: the block's error
||block(X) - Y||^2 couples its matrices through attention and the MLP's gate, and its gradient
(a probe backward through one block, reduced across ranks like any probe gradient) moves the
surviving weights of every matrix of the block at once.

Per block:
  1. X: the block's inputs from the pruned blocks below (block 0's: captured from one forward).
  2. Y = dense block(X), with the Hessians of each Linear's input hooked in (`InputStats`).
  3. masks and OBS-updated weights per matrix (`methods.sparsegpt_prune`, on this rank's rows).
  4. `steps` epochs of Adam on the masked block against Y; one Adam step per probe step (the
     runner's `grad_accum` micro-batches per rank), its gradient reduced across ranks as the
     engine reduces any gradient, the update element-wise on this rank's shard, pruned entries
     held at exactly zero.
  5. X <- pruned block(X) for the next block.
Memory above the model: one block's calibration inputs and targets, its Hessians (as SparseGPT),
and Adam's two fp32 moments for the block's local shard (8 B per local weight of one block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.distributed import Collectives
from harness.models import decoder_blocks
from harness.pruning.baselines import obs_prune
from harness.pruning.calibration import InputStats, Ledger, Runner
from harness.pruning.masks import MaskSet
from harness.pruning.method_run import MethodRun
from harness.pruning.methods import Rule
from harness.pruning.shards import ShardView, sync_views

Inputs = list[tuple[torch.Tensor, dict[str, Any]]]  # per calibration micro-batch: hidden states, keyword arguments


@dataclass(frozen=True)
class ReconSettings:
    steps: int = 1  # Adam epochs over the calibration set per block (0: SparseGPT streamed block by block)
    lr: float = 1e-3  # Adam's step size on the block's surviving weights
    dense_targets: bool = False  # Y from the dense model's own inputs (corrects the error of the blocks below too)


KV_CACHE_KEYS = ("cache", "past_key_values", "past_key_value", "layer_past")


class _Captured(Exception):
    """Ends a forward once block 0's inputs are captured (whole models only)."""


def capture_block_inputs(runner: Runner, batches: list[Any], block: nn.Module, stop_early: bool) -> Inputs:
    """Block 0's inputs (hidden states, keyword arguments) for each calibration micro-batch.

    `stop_early` raises out of the forward at block 0 (whole models: 1/L of a pass); sharded
    engines run the forward to its end, so their own hooks see a complete pass."""
    out: Inputs = []

    def grab(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        # A key/value cache would grow with every later call of a block: replayed without one.
        kw = {k: (None if k in KV_CACHE_KEYS else v) for k, v in kwargs.items() if k != "hidden_states"}
        if "use_cache" in kw:
            kw["use_cache"] = False
        out.append((hidden.detach(), kw))
        if stop_early:
            raise _Captured

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in batches:
            runner._check_stop()
            try:
                with torch.no_grad():
                    runner.loss_fn(runner.target, batch)
            except _Captured:
                pass
            runner.fwd_batches += 1.0 / len(decoder_blocks(runner.module)) if stop_early else 1
    finally:
        handle.remove()
    return out


def _out(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, tuple) else y


def _run_block(block: nn.Module, inputs: Inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [_out(block(h, **kw)) for h, kw in inputs]


class MaskedAdam:
    """Adam on this rank's shard of each view; pruned entries stay exactly zero."""

    def __init__(self, views: list[ShardView], masks: dict[str, torch.Tensor], lr: float, ledger: Ledger) -> None:
        self.views, self.masks, self.lr, self.t = views, masks, lr, 0
        self.m = {v.name: torch.zeros(v.local_numel, dtype=torch.float32, device=v.lp().device) for v in views}
        self.v = {v.name: torch.zeros_like(self.m[v.name]) for v in views}
        for v in views:
            ledger.add(f"recon/adam/{v.name}", 2 * v.local_numel * 4)

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        self.t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        for view in self.views:
            g, m, v = grads[view.name], self.m[view.name], self.v[view.name]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            upd = (m / (1 - b1**self.t)) / ((v / (1 - b2**self.t)).sqrt() + eps)
            new = torch.where(self.masks[view.name], torch.zeros_like(upd), view.weight() - self.lr * upd)
            view.write(torch.ones_like(self.masks[view.name]), new, master=True)


def _step_gradients(
    runner: Runner,
    block: nn.Module,
    views: list[ShardView],
    items: list[tuple[torch.Tensor, dict[str, Any], torch.Tensor]],
    scale: float,
    comm: Collectives,
) -> dict[str, torch.Tensor]:
    """This rank's range of the gradient of one probe step's block error, summed over the step's
    micro-batches of every rank and divided by their count (what a probe step's reduced gradient
    is, `Runner`).

    Wherever the forward sees whole weight tensors (one process, DDP, ZeRO-1/2, and ZeRO-3, which
    gathers a block's weights for its forward and backward) the targets' gradients are asked of
    autograd alone and reduced here, one block's worth of full gradients at a time: the arithmetic
    is then the same at every world size, and no engine hook runs outside the engine's own step.
    FSDP2's forward runs on unsharded copies of its DTensor parameters, so there the backward runs
    and FSDP2's reduce-scatter (an average over ranks) delivers the range."""
    params = [v.param for v in views]
    n = len(items)
    share = 1.0 / len(decoder_blocks(runner.module))  # a block's fwd+bwd: this share of a model pass

    def loss_of(x: torch.Tensor, kw: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
        return (_out(block(x, **kw)) - y).float().pow(2).sum() / scale

    if not runner.probe.forward_sees_whole(params):
        for x, kw, y in items:
            (loss_of(x, kw, y) / n).backward()
            runner.fwd_bwd_batches += share
        grads = {v.name: v.grad().clone() for v in views}
        runner.zero_grad()
        return grads
    acc: list[torch.Tensor] | None = None
    for x, kw, y in items:
        gs = torch.autograd.grad(loss_of(x, kw, y) / n, params)
        acc = [g.detach().float() for g in gs] if acc is None else [a.add_(g) for a, g in zip(acc, gs)]
        runner.fwd_bwd_batches += share
    assert acc is not None
    if comm.distributed:
        acc = [comm.all_reduce_sum(g.div_(comm.world)) for g in acc]
    return {v.name: g.reshape(-1)[v.start : v.end].clone() for v, g in zip(views, acc)}


def reconstruct_block(
    runner: Runner,
    block: nn.Module,
    views: list[ShardView],
    masks: dict[str, torch.Tensor],
    inputs: Inputs,
    targets: list[torch.Tensor],
    settings: ReconSettings,
    comm: Collectives,
    ledger: Ledger,
) -> None:
    """`settings.steps` epochs of masked Adam on the block's surviving weights against `targets`."""
    energy = torch.tensor([sum(float(y.float().pow(2).sum()) for y in targets)], dtype=torch.float64)
    scale = float(comm.all_reduce_sum(energy.to(comm.device)).item()) / max(1, len(targets) * comm.world) or 1.0
    opt = MaskedAdam(views, masks, settings.lr, ledger)
    items = [(x, kw, y) for (x, kw), y in zip(inputs, targets)]
    for _ in range(settings.steps):
        for i in range(0, len(items), runner.accum):
            runner._check_stop()
            opt.step(_step_gradients(runner, block, views, items[i : i + runner.accum], scale, comm))
            sync_views(views, comm)
    ledger.drop("recon/adam/")


def run_reconstruct(
    runner: Runner,
    batches: list[Any],
    views: list[ShardView],
    rule: Rule,
    comm: Collectives,
    ledger: Ledger,
    settings: ReconSettings,
    forced: dict[str, torch.Tensor] | None = None,
    alloc: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Prune block by block (see the module docstring); returns this rank's masks. Collective."""
    if rule.kind not in ("per_matrix", "nm"):
        raise ValueError(f"the reconstruct mode selects per block of columns (unstructured) or N:M, not {rule.kind}")
    forced = forced or {}
    blocks = decoder_blocks(runner.module)
    masks: dict[str, torch.Tensor] = {}
    outside = [v.name for v in views if v.target.unit >= len(blocks)]
    if outside:
        raise ValueError(f"the reconstruct mode prunes decoder-block Linears only; {outside[0]} is outside the blocks")
    whole = runner.probe.computes_alone([v.param for v in views])  # one process or DDP: the forward may stop at block 0
    inputs = capture_block_inputs(runner, batches, blocks[0], stop_early=whole)
    dense = [(h.clone(), kw) for h, kw in inputs] if settings.dense_targets else None
    n_blocks = len(blocks)
    for u, block in enumerate(blocks):
        runner._check_stop()
        mine = [v for v in views if v.target.unit == u]
        stats = InputStats(mine, hessian=True, ledger=ledger)
        with stats:
            targets = _run_block(block, inputs)
        runner.fwd_batches += len(inputs) / n_blocks
        stats.finalize(comm)
        if dense is not None:
            targets = _run_block(block, dense)
            dense = [(y, kw) for y, (_, kw) in zip(targets, dense)]
            runner.fwd_batches += len(inputs) / n_blocks
        masks.update(obs_prune(mine, stats, rule, alloc, forced, comm, ledger))
        del stats
        ledger.add("recon/activations", sum(h.numel() * h.element_size() for h, _ in inputs) * (3 if dense is not None else 2))
        if settings.steps and mine:
            reconstruct_block(runner, block, mine, masks, inputs, targets, settings, comm, ledger)
        inputs = [(o, kw) for o, (_, kw) in zip(_run_block(block, inputs), inputs)]
        runner.fwd_batches += len(inputs) / n_blocks
        ledger.drop("recon/activations")
    return masks


def run(r: MethodRun) -> MaskSet:
    """GradProbe's `decision=reconstruct` as the registry runs it: every group's views (one block
    each), SparseGPT's rule, the config's fit (`prune.recon_steps`, `prune.recon_lr`)."""
    views = [v for group in r.groups for v in group]
    settings = ReconSettings(steps=r.cfg.recon_steps, lr=r.cfg.recon_lr)
    return MaskSet(run_reconstruct(r.runner, r.batches, views, r.rule, r.comm, r.ledger, settings, r.forced, r.allocation))
