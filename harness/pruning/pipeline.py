"""`run_pruning`: the pruning pipeline (calibrate, score, select, mask), on the trainer's own model
or engine, at any world size. The run's pruning *stage* (prune after training, fine-tune with
the masks) is `harness.runner.prune_stage`, which calls it.

One entry point for every method so that they share the calibration passes, the
selection rules and the report: a comparison between methods then measures the methods,
not four different harnesses.

Passes over the calibration data, per method (K = layers per group, L = layers):
  magnitude  0
  wanda      1 forward (statistics for every layer at once; `sequential`: one per group)
  sparsegpt  1 forward per group (each group is pruned and updated before the next)
  gradprobe  2 forward+backward per group: 2 when K = all, 2L when K = 1; decision=original:
             one group per matrix, so 2 per matrix (the original's low-memory streaming).
             On whole weights (one process, DDP) a pass computes only the probed gradients
             and replays the blocks below them (`Runner`, `PrefixCache`): deep groups cost less.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.config import PruneConfig, check_original, is_original, is_reconstruct, resolve_prune
from harness.distributed import Collectives
from harness.pruning.allocation import view_sparsities
from harness.pruning.calibration import InputStats, Ledger, LossFn, Runner, default_group_size, forward_pass
from harness.pruning.experimental import owl_sparsities
from harness.pruning.gradprobe import ProbeSettings, run_gradprobe
from harness.pruning.masks import MaskSet
from harness.pruning.methods import (
    Rule,
    magnitude_scores,
    make_rule,
    score_keys,
    select,
    sparsegpt_prune,
    wanda_scores,
)
from harness.pruning.reconstruct import ReconSettings, run_reconstruct
from harness.pruning.select import FLOAT_KEY_BITS, parse_pattern
from harness.pruning.shards import ShardView, build_views, sync_views
from harness.training import DTYPES

log = logging.getLogger(__name__)

# Exact-target GradProbe probes this many times more candidates than it prunes (1.25x
# the target): enough room to keep the worst offenders, small enough that the pool stays
# among weights the base strategy already considers unimportant. Read from
# `PruneConfig.pool` when the config has that field.
DEFAULT_POOL = 0.25


@dataclass
class LayerReport:
    name: str
    numel: int
    pruned: int

    @property
    def sparsity(self) -> float:
        return self.pruned / self.numel if self.numel else 0.0


@dataclass
class PruneReport:
    """What the pipeline did; `to_dict()` is what gets logged and written to notes."""

    method: str
    pattern: str
    target_sparsity: float
    achieved_sparsity: float  # over the pruned (target) layers
    layers: list[LayerReport]
    group_size: int  # K decoder blocks per group (decision=original: 1, one matrix per group)
    groups: int
    fwd_passes: float  # passes over the calibration set, forward only
    fwd_bwd_passes: float  # passes over the calibration set, forward + backward
    wall_time_s: float
    peak_probe_bytes: int  # the pipeline's own buffers on this rank (ledger), max over ranks
    peak_device_bytes: int | None  # CUDA allocator peak above the start, max over ranks (None on CPU)
    world_size: int
    exact_target: bool
    masks: MaskSet = field(repr=False)
    g0: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # local G0 shards (keep_g0)
    # Of the fwd+bwd passes, the share whose blocks below the probed ones were replayed, not computed.
    replayed_passes: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("masks", "g0", "layers")}
        out["layers"] = [{"name": x.name, "numel": x.numel, "pruned": x.pruned, "sparsity": x.sparsity} for x in self.layers]
        return out

    def _replayed(self) -> str:
        return f" ({self.replayed_passes:g} with the lower blocks replayed)" if self.replayed_passes else ""

    def summary(self) -> str:
        return (
            f"pruned {self.method} {self.pattern}: sparsity {self.achieved_sparsity:.4f} (target {self.target_sparsity:g}) "
            f"over {len(self.layers)} matrices, K={self.group_size} ({self.groups} groups), "
            f"passes fwd {self.fwd_passes:g} fwd+bwd {self.fwd_bwd_passes:g}{self._replayed()}, {self.wall_time_s:.2f}s, "
            f"probe memory {self.peak_probe_bytes / 2**20:.2f} MiB/rank"
        )


def run_pruning(
    model_or_engine: Any,
    calib_batches: Iterable[Any],
    cfg: PruneConfig,
    loss_fn: LossFn,
    *,
    grad_accum: int | None = None,
    comm: Collectives | None = None,
    sequential: bool | None = None,
    prior: MaskSet | None = None,
    stat_dtype: torch.dtype | None = None,
    keep_g0: bool = False,
    apply: bool = True,
    pool: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PruneReport:
    """Prune the target Linears of `model_or_engine` in place and report.

    `calib_batches` are this rank's micro-batches (every rank the same count);
    `loss_fn(model_or_engine, batch)` returns the scalar loss. A probe step is
    `grad_accum` micro-batches (a DeepSpeed engine's own accumulation). `prior` masks stay
    pruned (iterative schedules, reloaded masks). `sequential` applies each group's result
    before the next group's statistics (default `cfg.sequential`, else the decision mode's:
    SparseGPT, whose update rewrites weights, and GradProbe's original mode). `stat_dtype`
    overrides `cfg.stat_dtype`. Unset config keys take the mode's defaults
    (`harness.config.prune_modes`); decision=original probes one matrix per group. `pool`:
    exact-target GradProbe's extra candidates (default `cfg.pool` if the config has it,
    else DEFAULT_POOL). `apply=False` returns masks without zeroing weights
    (not for SparseGPT, which rewrites weights). `should_stop`, asked before every
    calibration step on every rank (it may be a collective), ends the pruning with
    StopRequested, the weights left part-way. Collective: every rank calls it with the
    same config.
    """
    if cfg.method == "none":
        raise ValueError("prune.method is 'none': nothing to run")
    if sequential is not None:
        cfg = dataclasses.replace(cfg, sequential=sequential)
    if stat_dtype is not None:
        cfg = dataclasses.replace(cfg, stat_dtype=next(k for k, t in DTYPES.items() if t == stat_dtype))
    if cfg.decision == "original":
        check_original(cfg)
    cfg, filled = resolve_prune(cfg)
    sequential = bool(cfg.sequential)
    assert cfg.stat_dtype is not None and cfg.scope is not None and cfg.exact_target is not None
    stat_dtype = DTYPES[cfg.stat_dtype]  # prune.stat_dtype names the storage of G0 and G1
    comm = comm or Collectives()
    comm.barrier()
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and comm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()
    views = build_views(model_or_engine, cfg.targets, comm)
    if not views:
        raise ValueError(f"no Linear layers match targets={cfg.targets}")
    runner = Runner(model_or_engine, loss_fn, grad_accum, comm, should_stop=should_stop)
    batches = list(calib_batches)
    if comm.all_reduce_min_int(len(batches)) != len(batches) or comm.all_reduce_min_int(-len(batches)) != -len(batches):
        raise ValueError("every rank must pass the same number of calibration micro-batches")
    if cfg.method != "magnitude" and not batches:
        raise ValueError(f"prune.method={cfg.method} needs calibration batches")
    # The reconstruct mode chooses its masks by SparseGPT's rule (per block of columns, or N:M).
    rule = make_rule("sparsegpt" if is_reconstruct(cfg) else cfg.method, cfg.base, parse_pattern(cfg.pattern), cfg.sparsity, cfg.scope)
    if comm.rank == 0 and filled and is_original(cfg):
        log.info(f"prune: decision=original filled what the config left unset: {', '.join(filled)}")
    if not apply and (sequential or cfg.method == "sparsegpt"):
        raise ValueError("apply=False cannot be honoured by a sequential run (each group is applied before the next)")
    if cfg.method == "sparsegpt" and not sequential:
        raise ValueError("SparseGPT rewrites the weights of each group before the next is measured; sequential=False is not supported")

    if is_original(cfg):
        k, groups = 1, [[v] for v in views]  # one matrix at a time, in model order (build_views' order)
    elif is_reconstruct(cfg):  # one decoder block at a time
        k, groups = 1, [[v for v in views if v.target.unit == u] for u in sorted({v.target.unit for v in views})]
    else:
        units = sorted({v.target.unit for v in views})
        device = views[0].lp().device
        k = cfg.group_size or default_group_size(views, units, comm, hessian=cfg.method == "sparsegpt", device=device)
        k = max(1, min(k, len(units)))
        groups = [[v for v in views if v.target.unit in units[i : i + k]] for i in range(0, len(units), k)]
    forced = None if prior is None else {v.name: prior[v.name] for v in views if v.name in prior}
    ledger = Ledger()
    g0: dict[str, torch.Tensor] = {}

    with runner.eval_mode():
        alloc = _allocation(cfg, views, rule, runner, batches, comm, ledger)
        if cfg.method == "magnitude":
            masks = _magnitude(groups, rule, forced, comm, sequential, alloc)
        elif cfg.method == "wanda":
            masks = _wanda(groups, rule, forced, runner, batches, comm, sequential, ledger, alloc)
        elif cfg.method == "sparsegpt":
            masks = _sparsegpt(groups, rule, forced, runner, batches, comm, ledger, alloc)
        elif is_reconstruct(cfg):
            settings_r = ReconSettings(steps=cfg.recon_steps, lr=cfg.recon_lr)
            masks = MaskSet(run_reconstruct(runner, batches, views, rule, comm, ledger, settings_r, forced, alloc))
        elif cfg.method == "gradprobe":
            pool_frac = float(pool if pool is not None else getattr(cfg, "pool", DEFAULT_POOL))
            settings = ProbeSettings(
                base=cfg.base,
                reduction=cfg.reduction,
                threshold=cfg.threshold,
                exact=cfg.exact_target,
                pool=pool_frac,
                stat_dtype=stat_dtype,
                sequential=sequential,
                decision=cfg.decision,
                keep_g0=keep_g0,
                dense_candidates=is_original(cfg),
                allocation=alloc,
            )
            masks = run_gradprobe(groups, rule, settings, runner, runner.steps(batches), comm, ledger, forced)
            g0 = settings.g0
        else:
            raise ValueError(f"unknown prune.method {cfg.method!r}")
    if apply and not sequential:
        masks.apply(views, comm)
    masks.meta.update(method=cfg.method, pattern=cfg.pattern, sparsity=cfg.sparsity, base=cfg.base)

    counts = masks.counts(views, comm)
    layers = [LayerReport(name, numel, pruned) for name, pruned, numel in counts]
    total = sum(x.numel for x in layers)
    peak_dev = None
    if cuda:
        torch.cuda.synchronize()
        peak_dev = comm.all_reduce_min_int(-(torch.cuda.max_memory_allocated() - base_alloc)) * -1
    comm.barrier()
    n = max(1, len(batches))
    report = PruneReport(
        method=cfg.method,
        pattern=cfg.pattern,
        target_sparsity=cfg.sparsity,
        achieved_sparsity=sum(x.pruned for x in layers) / total,
        layers=layers,
        group_size=k,
        groups=len(groups),
        fwd_passes=runner.fwd_batches / n,
        fwd_bwd_passes=runner.fwd_bwd_batches / n,
        wall_time_s=time.perf_counter() - start,
        peak_probe_bytes=-comm.all_reduce_min_int(-ledger.peak),
        peak_device_bytes=peak_dev,
        world_size=comm.world,
        exact_target=cfg.exact_target,
        masks=masks,
        g0=g0,
        replayed_passes=runner.prefix.replays / n,
    )
    if comm.rank == 0:
        log.info(report.summary())
    return report


def _allocation(
    cfg: PruneConfig, views: list[ShardView], rule: Rule, runner: Runner, batches: list[Any], comm: Collectives, ledger: Ledger
) -> dict[str, float] | None:
    """Per-matrix sparsities of a non-uniform allocation (None: uniform). OWL reads the dense
    model's input norms: one forward pass of its own, counted in the report's passes."""
    if cfg.allocation == "uniform":
        return None
    if rule.kind not in ("per_row", "per_matrix"):
        raise ValueError(f"prune.allocation={cfg.allocation} allocates unstructured sparsity per block; not with {rule.kind} selection")
    stats = InputStats(views, hessian=False, ledger=ledger)
    forward_pass(runner, batches, stats)
    stats.finalize(comm)
    alloc = owl_sparsities(views, stats, cfg.sparsity, cfg.owl_lambda, cfg.owl_m, comm)
    ledger.drop("stats/")
    return alloc


def _magnitude(
    groups: list[list[ShardView]],
    rule: Rule,
    forced: dict[str, torch.Tensor] | None,
    comm: Collectives,
    sequential: bool,
    alloc: dict[str, float] | None = None,
) -> MaskSet:
    forced = forced or {}
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


def _wanda(
    groups: list[list[ShardView]],
    rule: Rule,
    forced: dict[str, torch.Tensor] | None,
    runner: Runner,
    batches: list[Any],
    comm: Collectives,
    sequential: bool,
    ledger: Ledger,
    alloc: dict[str, float] | None = None,
) -> MaskSet:
    """Scores |W| * ||X_j||; the norms need one forward pass (per group when sequential)."""
    forced = forced or {}
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


def _sparsegpt(
    groups: list[list[ShardView]],
    rule: Rule,
    forced: dict[str, torch.Tensor] | None,
    runner: Runner,
    batches: list[Any],
    comm: Collectives,
    ledger: Ledger,
    alloc: dict[str, float] | None = None,
) -> MaskSet:
    """Hessians of a group from one forward pass, then the OBS update, written in place."""
    if rule.kind == "global":
        raise ValueError("SparseGPT selects within blocks of columns; scope=global does not apply (use per_matrix)")
    forced = forced or {}
    masks: dict[str, torch.Tensor] = {}
    for gi, views in enumerate(groups):
        stats = InputStats(views, hessian=True, ledger=ledger)
        forward_pass(runner, batches, stats)
        stats.finalize(comm)
        for v in views:
            assert v.layout is not None
            own = dataclasses.replace(rule, sparsity=alloc[v.name]) if alloc else rule
            values, mask = sparsegpt_prune(v.layout, v.weight(), stats.hessian_of(v.name), own, comm, forced.get(v.name))
            v.write(torch.ones_like(mask), values, master=True)
            masks[v.name] = mask
            ledger.add(f"mask/{v.name}", mask)
        sync_views(views, comm)
        ledger.drop("stats/")
        del stats
    return MaskSet(masks)
