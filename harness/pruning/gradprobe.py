"""GradProbe: let the loss gradient veto a base pruner's candidates, group by group.

For each group of K layers (two passes of forward+backward over the calibration steps,
whatever K is): G0 = max over steps of |grad| with the dense weights; shrink the group's
candidates by `reduction` (not to zero: the probe asks "does the loss start leaning on
these weights?"); G1 the same way; restore the weights bit-exactly. Then
- original mode: prune a candidate iff G1 <= G0 * (1 + threshold) (sparsity may fall short);
- exact-target mode: the candidate pool is `pool` x larger than the target, ranked by
  G1/G0 (at the stored bf16 precision; ties by base score, then index); the lowest
  ranked are pruned up to exactly the target and the worst offenders are kept.

G0 is always taken on the model as it was when `run_pruning` started unless `sequential` is
set, so K=1 and K=all see the same G0 and K is a memory knob. G1 differs with K by
design: it measures shrinking the candidates of the probed group only.

Candidates are chosen per group from the model as each group finds it, except when they are
fixed once up front from the model as `run_pruning` found it: a global selection (one threshold
over every matrix), and `dense_candidates` (the original GradProbe, whose strategy picks its
candidates once on the dense model before streaming through the matrices; a Wanda base then
takes its input norms for every matrix from the first G0 pass, which still sees that model).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from harness.config import is_original
from harness.distributed import Collectives
from harness.pruning.allocation import view_sparsities
from harness.pruning.calibration import InputStats, Ledger, Runner, gradient_max
from harness.pruning.decisions import DECISIONS, MatrixProbe, decision_keys
from harness.pruning.experimental import GRADIENT_BASES, NORM_BASES, base_scores
from harness.pruning.masks import MaskSet
from harness.pruning.method_run import MethodRun
from harness.pruning.methods import (
    COMPOSITE_BITS,
    Rule,
    gradient_ratio,
    magnitude_scores,
    original_decision,
    score_keys,
    select,
    wanda_scores,
    widen,
)
from harness.pruning.select import FLOAT_KEY_BITS
from harness.pruning.shards import ShardView, sync_views
from harness.training import DTYPES


@dataclass
class ProbeSettings:
    base: str  # one of methods' bases (PRUNE_BASES)
    reduction: float
    threshold: float
    exact: bool
    pool: float
    stat_dtype: torch.dtype
    sequential: bool
    decision: str = "veto"  # exact target: rank the pool by G1/G0 | veto: base order, G1/G0 only vetoes | saliency
    allocation: dict[str, float] | None = None  # per-matrix sparsities (OWL); None: the rule's, uniform
    dense_candidates: bool = False  # candidates of every matrix chosen once, before the first group is probed

    @classmethod
    def of(cls, run: MethodRun) -> ProbeSettings:
        """GradProbe's own settings, from the run's resolved config (the original mode's
        candidates are fixed once on the dense model)."""
        cfg = run.cfg
        assert cfg.stat_dtype is not None and cfg.exact_target is not None
        return cls(
            base=cfg.base,
            reduction=cfg.reduction,
            threshold=cfg.threshold,
            exact=cfg.exact_target,
            pool=float(cfg.pool),
            stat_dtype=DTYPES[cfg.stat_dtype],  # prune.stat_dtype names the storage of G0 and G1
            sequential=run.sequential,
            decision=cfg.decision,
            dense_candidates=is_original(cfg),
            allocation=run.allocation,
        )


INPUT_NORM_BASES = ("wanda", *NORM_BASES)  # bases whose first pass collects input norms


def _base_scores(v: ShardView, base: str, stats: InputStats | None, grad_sumsq: dict[str, torch.Tensor], comm: Collectives) -> torch.Tensor:
    """The base score of this rank's piece of `v` (lowest pruned first): magnitude and wanda
    here, the experimental bases from `harness.pruning.experimental` (collective for the ones
    that normalise over the whole matrix, gblm and ria: every rank calls it per view)."""
    w = v.weight()
    if base == "magnitude":
        return magnitude_scores(w)
    norms = stats.norms(v.name) if stats is not None else None
    if base == "wanda":
        assert norms is not None
        return wanda_scores(w, v.features(w.device), norms)
    return base_scores(base, w, v.layout, v.features(w.device), norms, grad_sumsq.get(v.name), comm)


@torch.no_grad()
def _scale(views: list[ShardView], pools: dict[str, torch.Tensor], factor: float, comm: Collectives) -> dict[str, torch.Tensor]:
    """Multiply each pool's working weights by `factor`; returns the exact old values."""
    saved = {}
    for v in views:
        pool = pools[v.name].to(v.lp().device)
        saved[v.name] = v.lp()[pool].clone()
        v.write(pool, (saved[v.name].float() * factor), master=False)
    sync_views(views, comm)
    return saved


@torch.no_grad()
def _restore(views: list[ShardView], pools: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], comm: Collectives) -> None:
    for v in views:
        v.write(pools[v.name].to(v.lp().device), saved[v.name], master=False)
    sync_views(views, comm)


def _base_keys(base: dict[str, torch.Tensor], forced: dict[str, torch.Tensor], v: ShardView) -> torch.Tensor:
    return score_keys(base[v.name], forced.get(v.name))


def _decision_keys(
    settings: ProbeSettings,
    pools: dict[str, torch.Tensor],
    g0: dict[str, torch.Tensor],
    g1: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor],
    sum0: dict[str, torch.Tensor],
    sum1: dict[str, torch.Tensor],
    forced: dict[str, torch.Tensor],
    v: ShardView,
) -> torch.Tensor:
    """One matrix's keys for the exact-target decision (lowest pruned first, outside the pool last)."""
    sums = DECISIONS[settings.decision].facts.probes_sums
    probe = MatrixProbe(
        pools[v.name],
        g0[v.name],
        g1[v.name],
        base[v.name],
        forced.get(v.name),
        weight=v.weight() if sums else None,
        sum0=sum0.get(v.name),
        sum1=sum1.get(v.name),
    )
    return decision_keys(settings.decision, probe, settings.threshold, settings.reduction)


def _select_one_at_a_time(
    rule: Rule,
    views: list[ShardView],
    make_keys: Callable[[ShardView], torch.Tensor],
    comm: Collectives,
    key_bits: int,
    sparsities: list[float] | None,
    within_pool: bool = False,
) -> dict[str, torch.Tensor]:
    """`select` of `rule` over `views`, one matrix at a time: a per-matrix, per-row or N:M rule
    decides each matrix on its own keys, so the masks are those of one call over the group, and
    the int64 keys (8 B a weight) exist for one matrix at a time instead of the whole group's.
    `within_pool`: the keys mark what lies outside the candidate pool, which must not be chosen."""
    masks = {}
    for i, v in enumerate(views):
        keys = make_keys(v)
        (mask,) = select(rule, [v.layout], [keys], comm, key_bits, None if sparsities is None else [sparsities[i]])
        if within_pool and (keys[mask] == (1 << COMPOSITE_BITS)).any():
            raise RuntimeError(f"{v.name}: the selection reached outside the candidate pool")
        masks[v.name] = mask
        del keys
    return masks


def run_gradprobe(
    groups: list[list[ShardView]],
    rule: Rule,
    settings: ProbeSettings,
    runner: Runner,
    steps: list[list[Any]],
    comm: Collectives,
    ledger: Ledger,
    forced: dict[str, torch.Tensor] | None,
) -> MaskSet:
    """The masks GradProbe chooses for every view (applied per group if `sequential`)."""
    _check(rule, settings)
    forced = forced or {}
    cand_rule = widen(rule, settings.pool) if settings.exact else rule
    widening = settings.pool if settings.exact else 0.0
    all_views = [v for g in groups for v in g]
    upfront = rule.kind == "global" or settings.dense_candidates
    fixed_pool: dict[str, torch.Tensor] = {}  # upfront: every matrix's candidates

    def choose_upfront(base: str, stats: InputStats | None) -> None:
        keys = [score_keys(_base_scores(v, base, stats, {}, comm), forced.get(v.name)) for v in all_views]
        sparsities = view_sparsities(all_views, settings.allocation, widening)
        fixed_pool.update(
            zip([v.name for v in all_views], select(cand_rule, [v.layout for v in all_views], keys, comm, FLOAT_KEY_BITS, sparsities))
        )
        for name, m in fixed_pool.items():
            ledger.add(f"pool/{name}", m)

    if upfront and settings.base == "magnitude":
        choose_upfront("magnitude", None)
    masks: dict[str, torch.Tensor] = {}
    deferred: dict[str, torch.Tensor] = {}  # global exact mode: bf16 ratios until every group is probed
    for gi, views in enumerate(groups):
        dense_norms = upfront and settings.base == "wanda" and gi == 0  # the first pass still sees the dense model
        norms_here = settings.base in INPUT_NORM_BASES and (not upfront or dense_norms)
        stats = InputStats(all_views if dense_norms else views, hessian=False, ledger=ledger) if norms_here else None
        grad_sumsq: dict[str, torch.Tensor] = {}
        saliency = DECISIONS[settings.decision].facts.probes_sums
        sum0: dict[str, torch.Tensor] = {}
        sum1: dict[str, torch.Tensor] = {}
        g0 = gradient_max(
            runner,
            steps,
            views,
            settings.stat_dtype,
            stats,
            ledger,
            tag=f"G0/{gi}/",
            sumsq=grad_sumsq if settings.base in GRADIENT_BASES and not upfront else None,
            signed=sum0 if saliency else None,
        )
        if stats is not None:
            stats.finalize(comm)
        if dense_norms:
            choose_upfront("wanda", stats)
        for record in _G0_RECORDS:
            record.update({k: t.clone() for k, t in g0.items()})
        base = {} if upfront else {v.name: _base_scores(v, settings.base, stats, grad_sumsq, comm) for v in views}
        del grad_sumsq
        if upfront:
            pools = {v.name: fixed_pool[v.name] for v in views}
        else:
            pools = _select_one_at_a_time(
                cand_rule,
                views,
                functools.partial(_base_keys, base, forced),
                comm,
                FLOAT_KEY_BITS,
                view_sparsities(views, settings.allocation, widening),
            )
            for name, m in pools.items():
                ledger.add(f"pool/{name}", m)
        g1 = _shrunk_gradients(views, pools, settings, runner, steps, comm, ledger, f"G1/{gi}/", sum1 if saliency else None)
        probed = _Probed(pools, g0, g1, base, sum0, sum1)
        _decide(rule, settings, views, probed, forced, comm, ledger, masks, deferred)
        _close_group(views, masks, settings.sequential, comm, ledger, gi, drop_pools=not upfront)
        del g0, g1, base, sum0, sum1, probed
    if deferred:
        masks.update(_select_deferred(rule, settings, all_views, fixed_pool, deferred, forced, comm))
    return MaskSet(masks)


def _shrunk_gradients(
    views: list[ShardView],
    pools: dict[str, torch.Tensor],
    settings: ProbeSettings,
    runner: Runner,
    steps: list[list[Any]],
    comm: Collectives,
    ledger: Ledger,
    tag: str,
    signed: dict[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """G1: max |grad| over one fwd+bwd pass with the group's candidates shrunk by `reduction`,
    the weights restored bit-exactly afterwards."""
    saved = _scale(views, pools, settings.reduction, comm)
    for name, t in saved.items():
        ledger.add(f"saved/{name}", t)
    g1 = gradient_max(runner, steps, views, settings.stat_dtype, None, ledger, tag=tag, signed=signed)
    _restore(views, pools, saved, comm)
    ledger.drop("saved/")
    return g1


def _close_group(
    views: list[ShardView], masks: dict[str, torch.Tensor], sequential: bool, comm: Collectives, ledger: Ledger, gi: int, drop_pools: bool
) -> None:
    """After a group's decision: its statistics leave the ledger, its masks enter it, and a
    sequential run applies them before the next group is probed."""
    for v in views:
        if v.name in masks:
            ledger.add(f"mask/{v.name}", masks[v.name])
    ledger.drop(f"G0/{gi}/")
    ledger.drop(f"G1/{gi}/")
    if drop_pools:
        ledger.drop("pool/")
    if sequential:
        MaskSet({v.name: masks[v.name] for v in views}).apply(views, comm)


def _check(rule: Rule, settings: ProbeSettings) -> None:
    """Refuse the combinations no GradProbe decision can honour (library callers reach here without a run config's checks)."""
    if rule.kind == "global" and settings.base == "wanda":
        raise ValueError("GradProbe on a Wanda base compares within rows; scope=global does not apply")
    if rule.kind == "global" and DECISIONS[settings.decision].facts.per_matrix_only:
        raise ValueError(
            f"the {settings.decision} decision ranks each matrix's pool on its own; scope=global does not apply (use per_matrix)"
        )
    if rule.kind == "global" and settings.sequential and settings.exact:
        raise ValueError("an exact-target global ranking needs every matrix probed before any is pruned; sequential=True contradicts it")
    if settings.dense_candidates and settings.exact:
        raise ValueError("candidates fixed on the dense model belong to the original veto (exact_target=false)")
    if rule.kind == "nm" and not settings.exact:
        raise ValueError(
            "N:M with exact_target=false: the original veto leaves some groups with fewer than M-N zeros, which no N:M "
            "kernel can store; use exact_target=true"
        )


@dataclass
class _Probed:
    """One group's probe: the candidate pools, G0 and G1 (max |grad|), the base scores, and the
    signed gradient sums of the saliency decision (empty otherwise)."""

    pools: dict[str, torch.Tensor]
    g0: dict[str, torch.Tensor]
    g1: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]
    sum0: dict[str, torch.Tensor]
    sum1: dict[str, torch.Tensor]


def _decide(
    rule: Rule,
    settings: ProbeSettings,
    views: list[ShardView],
    probed: _Probed,
    forced: dict[str, torch.Tensor],
    comm: Collectives,
    ledger: Ledger,
    masks: dict[str, torch.Tensor],
    deferred: dict[str, torch.Tensor],
) -> None:
    """One group's decision into `masks`: the original veto (undershoots), or exactly the target
    ranked within each matrix; a global exact ranking keeps the group's G1/G0 in `deferred`
    until every group is probed (`_select_deferred`)."""
    p = probed
    if not settings.exact:
        for v in views:
            masks[v.name] = original_decision(p.pools[v.name], p.g0[v.name], p.g1[v.name], settings.threshold, forced.get(v.name))
    elif rule.kind == "global":
        for v in views:
            deferred[v.name] = gradient_ratio(p.g0[v.name], p.g1[v.name]).to(torch.bfloat16)
            ledger.add(f"ratio/{v.name}", deferred[v.name])
    else:
        decide = functools.partial(_decision_keys, settings, p.pools, p.g0, p.g1, p.base, p.sum0, p.sum1, forced)
        sparsities = view_sparsities(views, settings.allocation)
        masks.update(_select_one_at_a_time(rule, views, decide, comm, COMPOSITE_BITS + 1, sparsities, within_pool=True))


def _select_deferred(
    rule: Rule,
    settings: ProbeSettings,
    views: list[ShardView],
    pools: dict[str, torch.Tensor],
    ratios: dict[str, torch.Tensor],
    forced: dict[str, torch.Tensor],
    comm: Collectives,
) -> dict[str, torch.Tensor]:
    """The global exact ranking, once every group is probed: one selection over every matrix's
    pool by its stored G1/G0, magnitude breaking ties."""
    ones = {v.name: torch.ones_like(ratios[v.name]) for v in views}
    keys = [
        decision_keys(
            settings.decision,
            MatrixProbe(pools[v.name], ones[v.name], ratios[v.name], magnitude_scores(v.weight()), forced.get(v.name)),
            settings.threshold,
            settings.reduction,
        )
        for v in views
    ]
    masks = {}
    for v, k, m in zip(views, keys, select(rule, [v.layout for v in views], keys, comm, COMPOSITE_BITS + 1)):
        if (k[m] == (1 << COMPOSITE_BITS)).any():
            raise RuntimeError(f"{v.name}: the selection reached outside the candidate pool")
        masks[v.name] = m
    return masks


def run(run: MethodRun) -> MaskSet:
    """The registry's entry: GradProbe over the run's groups, its probe steps of `grad_accum` micro-batches."""
    settings = ProbeSettings.of(run)
    return run_gradprobe(run.groups, run.rule, settings, run.runner, run.runner.steps(run.batches), run.comm, run.ledger, run.forced)


_G0_RECORDS: list[dict[str, torch.Tensor]] = []  # open `recording_g0` blocks


@contextlib.contextmanager
def recording_g0() -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block, every GradProbe run copies each group's G0 (this rank's range of each
    matrix, at `prune.stat_dtype`) into the dict yielded: the statistic as the run computed it,
    for comparisons across group sizes, worlds and modes. Costs a copy of G0 while open."""
    record: dict[str, torch.Tensor] = {}
    _G0_RECORDS.append(record)
    try:
        yield record
    finally:
        _G0_RECORDS.remove(record)
