"""The baseline methods' passes: magnitude (no data), Wanda (input norms, one forward pass) and
SparseGPT (input Hessians and the OBS update, one forward pass per group). Each is a `run` of
`harness.pruning.registry` over a `MethodRun`."""

from __future__ import annotations

import dataclasses

import torch

from harness.distributed import Collectives
from harness.pruning.allocation import view_sparsities
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
    """Scores |W| * ||X_j||; the norms need one forward pass (per group when sequential)."""
    groups, rule, forced, runner, batches, comm, ledger = run.groups, run.rule, run.forced, run.runner, run.batches, run.comm, run.ledger
    sequential, alloc = run.sequential, run.allocation
    stats = None
    if not sequential:
        stats = InputStats([v for g in groups for v in g], hessian=False, ledger=ledger)
        forward_pass(runner, batches, stats)
        stats.finalize(comm)
    masks: dict[str, torch.Tensor] = {}
    for views in groups:
        if sequential:
            stats = InputStats(views, hessian=False, ledger=ledger)
            forward_pass(runner, batches, stats)
            stats.finalize(comm)
        assert stats is not None
        keys = [score_keys(wanda_scores(v.weight(), v.layout, stats.norms(v.name)), forced.get(v.name)) for v in views]
        _select_group(views, keys, rule, comm, alloc, masks, sequential)
    return MaskSet(masks)


def sparsegpt(run: MethodRun) -> MaskSet:
    """Hessians of a group from one forward pass, then the OBS update, written in place."""
    groups, rule, forced, runner, batches, comm, ledger, alloc = (
        run.groups,
        run.rule,
        run.forced,
        run.runner,
        run.batches,
        run.comm,
        run.ledger,
        run.allocation,
    )
    if rule.kind == "global":
        raise ValueError("SparseGPT selects within blocks of columns; scope=global does not apply (use per_matrix)")
    masks: dict[str, torch.Tensor] = {}
    for gi, views in enumerate(groups):
        stats = InputStats(views, hessian=True, ledger=ledger)
        forward_pass(runner, batches, stats)
        stats.finalize(comm)
        masks.update(obs_prune(views, stats, rule, alloc, forced, comm, ledger))
        del stats
    return MaskSet(masks)


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
    re-synchronised. Shared by SparseGPT and GradProbe's reconstruct mode. Returns the masks."""
    masks: dict[str, torch.Tensor] = {}
    for v in views:
        assert v.layout is not None
        own = dataclasses.replace(rule, sparsity=alloc[v.name]) if alloc else rule
        values, mask = sparsegpt_prune(v.layout, v.weight(), stats.hessian_of(v.name), own, comm, forced.get(v.name))
        v.write(torch.ones_like(mask), values, master=True)
        masks[v.name] = mask
        ledger.add(f"mask/{v.name}", mask)
    sync_views(views, comm)
    ledger.drop("stats/")
    return masks
