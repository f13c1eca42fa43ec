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

from harness.config import PruneConfig, check_original, is_original, resolve_prune
from harness.distributed import Collectives
from harness.pruning.calibration import InputStats, Ledger, LossFn, Runner, default_group_size, forward_pass
from harness.pruning.experimental import owl_sparsities
from harness.pruning.masks import MaskSet
from harness.pruning.method_run import MethodRun
from harness.pruning.methods import Rule, make_rule
from harness.pruning.registry import method_of
from harness.pruning.shards import ShardView, build_views
from harness.training import DTYPES

log = logging.getLogger(__name__)


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
    exact-target GradProbe's extra candidates (default `cfg.pool`). `apply=False` returns masks without zeroing weights
    (not for SparseGPT, which rewrites weights). `should_stop`, asked before every
    calibration step on every rank (it may be a collective), ends the pruning with
    StopRequested, the weights left part-way. Collective: every rank calls it with the
    same config.
    """
    method = method_of(cfg)  # ValueError for `none`
    if sequential is not None:
        cfg = dataclasses.replace(cfg, sequential=sequential)
    if stat_dtype is not None:
        cfg = dataclasses.replace(cfg, stat_dtype=next(k for k, t in DTYPES.items() if t == stat_dtype))
    if pool is not None:
        cfg = dataclasses.replace(cfg, pool=pool)
    if cfg.decision == "original":
        check_original(cfg)
    cfg, filled = resolve_prune(cfg)
    sequential = bool(cfg.sequential)
    assert cfg.stat_dtype is not None and cfg.scope is not None and cfg.exact_target is not None
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
    if method.needs_calibration and not batches:
        raise ValueError(f"prune.method={cfg.method} needs calibration batches")
    rule = make_rule(cfg)
    if comm.rank == 0 and filled and is_original(cfg):
        log.info(f"prune: decision=original filled what the config left unset: {', '.join(filled)}")
    if not apply and (sequential or method.facts.rewrites_weights):
        raise ValueError("apply=False cannot be honoured by a sequential run (each group is applied before the next)")
    if method.facts.rewrites_weights and not sequential:
        raise ValueError(f"{cfg.method} rewrites the weights of each group before the next is measured; sequential=False is not supported")

    if is_original(cfg):
        k, groups = 1, [[v] for v in views]  # one matrix at a time, in model order (build_views' order)
    else:
        units = sorted({v.target.unit for v in views})
        device = views[0].lp().device
        k = cfg.group_size or default_group_size(views, units, comm, hessian=method.facts.hessian, device=device)
        k = max(1, min(k, len(units)))
        groups = [[v for v in views if v.target.unit in units[i : i + k]] for i in range(0, len(units), k)]
    forced = None if prior is None else {v.name: prior[v.name] for v in views if v.name in prior}
    ledger = Ledger()

    with runner.eval_mode():
        alloc = _allocation(cfg, views, rule, runner, batches, comm, ledger)
        run = MethodRun(cfg, groups, rule, forced or {}, runner, batches, comm, ledger, alloc, keep_g0)
        masks = method.run(run)
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
        g0=run.g0,
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
