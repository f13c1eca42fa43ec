"""The baseline methods' passes: magnitude (no data), Wanda (input norms) and SparseGPT (input
Hessians and the OBS update), the last two block by block on the pruned blocks' outputs as their
reference code runs them (`harness.pruning.blockwise`). Each is a `run` of
`harness.pruning.registry` over a `MethodRun`."""

from __future__ import annotations

import dataclasses

import torch

from harness.distributed import Collectives
from harness.pruning.allocation import view_sparsities
from harness.pruning.blockwise import stream_blocks
from harness.pruning.calibration import InputStats, Ledger, forward_pass
from harness.pruning.masks import MaskSet
from harness.pruning.method_run import MethodRun
from harness.pruning.methods import Rule, magnitude_scores, score_keys, select, sparsegpt_prune, wanda_scores
from harness.pruning.select import FLOAT_KEY_BITS
from harness.pruning.shards import ShardView, sync_views


def magnitude(run: MethodRun) -> MaskSet:
    """Scores |W|; reads no data."""
    groups, rule, forced, comm, sequential, alloc = run.groups, run.rule, run.forced, run.comm, run.sequential, run.allocation
    chunks = [[v for g in groups for v in g]] if rule.kind == "global" else groups
    masks: dict[str, torch.Tensor] = {}
    for views in chunks:
        keys = [score_keys(magnitude_scores(v.weight()), forced.get(v.name)) for v in views]
        _select_group(views, keys, rule, comm, alloc, masks, sequential)
    return MaskSet(masks)


def _select_group(
    views: list[ShardView],
    keys: list[torch.Tensor],
    rule: Rule,
    comm: Collectives,
    alloc: dict[str, float] | None,
    masks: dict[str, torch.Tensor],
    sequential: bool,
) -> None:
    """Select one group's masks from its score keys into `masks`; when sequential, apply them
    at once, so the next group is scored on the model with this group pruned."""
    for v, m in zip(views, select(rule, [v.layout for v in views], keys, comm, FLOAT_KEY_BITS, view_sparsities(views, alloc))):
        masks[v.name] = m
    if sequential:
        MaskSet({v.name: masks[v.name] for v in views}).apply(views, comm)


def wanda(run: MethodRun) -> MaskSet:
    """Scores |W| * ||X_j||. Sequential (the default, as Wanda's reference code runs): block by
    block, each block's norms from the pruned blocks' outputs (`blockwise`); otherwise every
    norm from one forward pass of the dense model (the paper's description)."""
    rule, forced, runner, batches, comm, ledger, alloc = run.rule, run.forced, run.runner, run.batches, run.comm, run.ledger, run.allocation
    views = [v for g in run.groups for v in g]
    masks: dict[str, torch.Tensor] = {}

    def prune(views: list[ShardView], stats: InputStats) -> dict[str, torch.Tensor]:
        keys = [score_keys(wanda_scores(v.weight(), v.features(v.lp().device), stats.norms(v.name)), forced.get(v.name)) for v in views]
        _select_group(views, keys, rule, comm, alloc, masks, run.sequential)
        return {v.name: masks[v.name] for v in views}

    if run.sequential:
        stream_blocks(runner, batches, views, comm, ledger, lambda b: prune(b.views, b.stats), hessian=False)
    else:
        stats = InputStats(views, hessian=False, ledger=ledger)
        forward_pass(runner, batches, stats)
        stats.finalize(comm)
        prune(views, stats)
    return MaskSet(masks)


def sparsegpt(run: MethodRun) -> MaskSet:
    """SparseGPT as published: block by block, each block's Hessians from the pruned blocks'
    outputs (`blockwise`), its masks chosen and surviving weights updated (OBS) before the next."""
    if run.rule.kind == "global":
        raise ValueError("SparseGPT selects within blocks of columns; scope=global does not apply (use per_matrix)")
    views = [v for g in run.groups for v in g]
    prune = lambda b: obs_prune(b.views, b.stats, run.rule, run.allocation, run.forced, run.comm, run.ledger)
    return MaskSet(stream_blocks(run.runner, run.batches, views, run.comm, run.ledger, prune, hessian=True))


def obs_prune(
    views: list[ShardView],
    stats: InputStats,
    rule: Rule,
    alloc: dict[str, float] | None,
    forced: dict[str, torch.Tensor],
    comm: Collectives,
    ledger: Ledger,
) -> dict[str, torch.Tensor]:
    """SparseGPT's step on one group whose Hessians `stats` holds: each view's mask chosen and its
    surviving weights updated (OBS), written to the weights and their master, then the replicas
    re-synchronised. Shared by SparseGPT and sparsegpt_fit. Returns the masks."""
    masks: dict[str, torch.Tensor] = {}
    for v in views:
        assert v.layout is not None
        own = dataclasses.replace(rule, sparsity=alloc[v.name]) if alloc else rule
        values, mask = sparsegpt_prune(v.layout, v.weight(), stats.hessian_of(v.name), own, comm, forced.get(v.name))
        v.write(slice(None), values, master=True)
        masks[v.name] = mask
        ledger.add(f"mask/{v.name}", mask)
    sync_views(views, comm)
    ledger.drop("stats/")
    return masks
