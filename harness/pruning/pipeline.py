"""`run_pruning`: the pruning pipeline (calibrate, score, select, mask), on the trainer's own model
or engine, at any world size. The run's pruning *stage* (prune after training, fine-tune with
the masks) is `harness.runner.prune_stage`, which calls it.

One entry point for every method so that they share the calibration passes, the
selection rules and the report: a comparison between methods then measures the methods,
not four different harnesses.

Passes over the calibration data, per method (K = layers per group, L = layers):
  magnitude  0
  wanda      sequential (the default): 1 forward to capture block 0's inputs, then 2 per block
             (dense, pruned) = about 3 passes; not sequential: 1 forward
  sparsegpt  as sequential Wanda (each block pruned and updated before the next: `blockwise`)
  sparsegpt_fit  as SparseGPT, plus `fit_epochs` fwd+bwd passes through each block (the guard:
             one more per step size tried)
  gradprobe  2 forward+backward per group: 2 when K = all, 2L when K = 1; decision=original:
             one group per matrix, so 2 per matrix (the original's low-memory streaming).
             On whole weights (one process, DDP) a pass computes only the probed gradients
             and replays the blocks below them (`Runner`, `PrefixCache`): deep groups cost less.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.config import PruneConfig, check_method_keys, check_original, decision_facts, is_original, method_facts, resolve_prune
from harness.distributed import Collectives
from harness.pruning.calibration import InputStats, Ledger, LossFn, Runner, default_group_size, forward_pass
from harness.pruning.experimental import owl_sparsities
from harness.pruning.masks import MaskSet
from harness.pruning.method_run import Method, MethodRun
from harness.pruning.methods import Rule, make_rule
from harness.pruning.registry import method_of
from harness.pruning.shards import ShardView, build_views

log = logging.getLogger(__name__)


@dataclass
class LayerReport:
    name: str
    numel: int
    pruned: int
    param: str = ""  # the parameter pruned (`Target.param_name`): where an export holds it

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "param": self.param, "numel": self.numel, "pruned": self.pruned, "sparsity": self.sparsity}

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
    # Of the fwd+bwd passes, the share whose blocks below the probed ones were replayed, not computed.
    replayed_passes: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)  # the method's own (sparsegpt_fit: the guard's verdict per block)
    # Stacked expert tensors this method and rule cannot prune, left whole: their elements, and why.
    unpruned_expert_parameters: int = 0
    unpruned_experts_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("masks", "layers")}
        out["layers"] = [x.to_dict() for x in self.layers]
        return out

    def _replayed(self) -> str:
        return f" ({self.replayed_passes:g} with the lower blocks replayed)" if self.replayed_passes else ""

    def _fitted(self) -> str:
        fits = self.details.get("fit")
        if not fits:
            return ""
        kept = sum(f["kept"] == "fit" for f in fits)
        return f", fit kept on {kept}/{len(fits)} blocks (SparseGPT's weights on the others)"

    def _left_whole(self) -> str:
        if not self.unpruned_expert_parameters:
            return ""
        return f"; stacked expert tensors left whole ({self.unpruned_expert_parameters:,} parameters): {self.unpruned_experts_reason}"

    def summary(self) -> str:
        return (
            f"pruned {self.method} {self.pattern}: sparsity {self.achieved_sparsity:.4f} (target {self.target_sparsity:g}) "
            f"over {len(self.layers)} matrices, K={self.group_size} ({self.groups} groups), "
            f"passes fwd {self.fwd_passes:g} fwd+bwd {self.fwd_bwd_passes:g}{self._replayed()}, {self.wall_time_s:.2f}s, "
            f"probe memory {self.peak_probe_bytes / 2**20:.2f} MiB/rank{self._fitted()}{self._left_whole()}"
        )


def stacked_experts_problem(cfg: PruneConfig, rule: Rule, view: ShardView) -> str | None:
    """Why this method and rule cannot prune a stacked expert tensor (None: it prunes each expert's
    rows as a Linear's). Every other score is per weight, or per row with each expert's own inputs."""
    t = view.target
    if not t.experts:
        return None
    if method_facts(cfg).rewrites_weights:
        return f"prune.method={cfg.method} updates kept weights from each matrix's input Hessian, which is not collected per expert"
    if cfg.method == "gradprobe" and cfg.base == "ria":
        return "prune.base=ria normalises by a matrix's column sums, which are not defined per expert"
    if rule.kind in ("per_row", "nm") and not t.rows_are_outputs:
        return (
            f"a {'per-row' if rule.kind == 'per_row' else 'N:M'} selection needs an output's weights in one row, and this family stores "
            "its experts as [experts, in, out]; prune.method=magnitude or prune.base=magnitude with prune.scope=per_matrix prunes them"
        )
    return None


def run_pruning(
    model_or_engine: Any,
    calib_batches: Iterable[Any],
    cfg: PruneConfig,
    loss_fn: LossFn,
    *,
    grad_accum: int | None = None,
    comm: Collectives | None = None,
    prior: MaskSet | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PruneReport:
    """Prune the target Linears of `model_or_engine` (a harness Engine, a DeepSpeed engine, DDP,
    an FSDP2 module or a plain module) in place and report.

    `calib_batches` are this rank's micro-batches (every rank the same count);
    `loss_fn(model_or_engine, batch)` returns the scalar loss. A probe step is `grad_accum`
    micro-batches (default: an engine's own accumulation, else 1). `prior` masks stay pruned
    (iterative schedules, reloaded masks). Every setting comes from `cfg`; its unset keys take
    the decision mode's defaults (`harness.config.prune_modes`: `sequential` for methods that
    rewrite weights and GradProbe's original mode, which probes one matrix per group).
    `should_stop`, asked before every calibration step on every rank (it may be a collective),
    ends the pruning with StopRequested, the weights left part-way. Collective: every rank
    calls it with the same config.
    """
    method = method_of(cfg)  # ValueError for `none`
    if decision_facts(cfg).original:
        check_original(cfg)
    check_method_keys(cfg)  # a key the method does not read (GradProbe's, the fit's) is refused, not ignored
    cfg, filled = resolve_prune(cfg)
    comm = comm or Collectives()
    comm.barrier()
    start, peak = time.perf_counter(), _DevicePeak(comm)
    runner = Runner(model_or_engine, loss_fn, grad_accum, comm, should_stop=should_stop)
    rule = make_rule(cfg)
    views, whole = [], {}
    for v in build_views(model_or_engine, cfg.targets, comm):
        problem = stacked_experts_problem(cfg, rule, v)
        if problem is None:
            views.append(v)
        else:
            whole[problem] = whole.get(problem, 0) + v.numel
    if not views:
        raise ValueError(f"no Linear layers match targets={cfg.targets}")
    batches = _checked_inputs(list(calib_batches), method, cfg, comm)
    if comm.rank == 0 and filled and is_original(cfg):
        log.info(f"prune: decision=original filled what the config left unset: {', '.join(filled)}")
    k, groups = _groups(cfg, method, views, comm)
    forced = {} if prior is None else {v.name: prior[v.name] for v in views if v.name in prior}
    ledger = Ledger()
    with runner.eval_mode():
        alloc = _allocation(cfg, views, rule, runner, batches, comm, ledger)
        run = MethodRun(cfg, groups, rule, forced, runner, batches, comm, ledger, alloc)
        masks = method.run(run)
    if not cfg.sequential:  # a sequential run applied each group before measuring the next
        masks.apply(views, comm)
    masks.meta.update(method=cfg.method, pattern=cfg.pattern, sparsity=cfg.sparsity, base=cfg.base)
    layers = [LayerReport(name, numel, pruned, v.target.param_name) for v, (name, pruned, numel) in zip(views, masks.counts(views, comm))]
    n, peak_device = max(1, len(batches)), peak.read()
    comm.barrier()
    report = PruneReport(
        method=cfg.method,
        pattern=cfg.pattern,
        target_sparsity=cfg.sparsity,
        achieved_sparsity=sum(x.pruned for x in layers) / sum(x.numel for x in layers),
        layers=layers,
        group_size=k,
        groups=len(groups),
        fwd_passes=runner.fwd_batches / n,
        fwd_bwd_passes=runner.fwd_bwd_batches / n,
        wall_time_s=time.perf_counter() - start,
        peak_probe_bytes=-comm.all_reduce_min_int(-ledger.peak),
        peak_device_bytes=peak_device,
        world_size=comm.world,
        exact_target=bool(cfg.exact_target),
        masks=masks,
        replayed_passes=runner.prefix.replays / n,
        details=run.details,
        unpruned_expert_parameters=sum(whole.values()),
        unpruned_experts_reason="; ".join(whole),
    )
    if comm.rank == 0:
        log.info(report.summary())
    return report


class _DevicePeak:
    """The CUDA allocator's peak above the start of pruning, max over ranks (None on CPU)."""

    def __init__(self, comm: Collectives) -> None:
        self.comm = comm
        self.cuda = torch.cuda.is_available() and comm.device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()

    def read(self) -> int | None:
        """Collective on CUDA."""
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return -self.comm.all_reduce_min_int(-(torch.cuda.max_memory_allocated() - self.base))


def _checked_inputs(batches: list[Any], method: Method, cfg: PruneConfig, comm: Collectives) -> list[Any]:
    """The calibration micro-batches, checked: every rank the same count (collective), some where
    the method reads data; a method that rewrites weights runs sequentially."""
    if comm.all_reduce_min_int(len(batches)) != len(batches) or comm.all_reduce_min_int(-len(batches)) != -len(batches):
        raise ValueError("every rank must pass the same number of calibration micro-batches")
    if method.facts.needs_calibration and not batches:
        raise ValueError(f"prune.method={cfg.method} needs calibration batches")
    if method.facts.rewrites_weights and not cfg.sequential:
        raise ValueError(
            f"prune.method={cfg.method} rewrites the weights of each group before the next is measured; sequential=False is not supported"
        )
    return batches


def _groups(cfg: PruneConfig, method: Method, views: list[ShardView], comm: Collectives) -> tuple[int, list[list[ShardView]]]:
    """(K, the groups): one decoder block per group for every method but GradProbe (Wanda and
    SparseGPT stream the blocks: `harness.pruning.blockwise`); GradProbe: K consecutive decoder blocks per group,
    from the config or from the free memory (`default_group_size`, the same on every rank);
    decision=original: one matrix at a time, in model order (`build_views`' order)."""
    if is_original(cfg):
        return 1, [[v] for v in views]
    units = sorted({v.target.unit for v in views})
    if not method.facts.reads_base:
        return 1, [[v for v in views if v.target.unit == u] for u in units]
    device = views[0].lp().device
    k = cfg.group_size or default_group_size(views, units, comm, device=device)
    k = max(1, min(k, len(units)))
    return k, [[v for v in views if v.target.unit in units[i : i + k]] for i in range(0, len(units), k)]


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
