"""GradProbe's iterative schedule: raise the target sparsity step by step, stop at a metric limit.

Each round prunes from the previous round's result (its mask is `prior`, so it stays
pruned), then evaluates `metric_fn`. The first round whose metric is worse than the
dense model's by more than `max_increase` (relative) is rolled back exactly: every target
shard (working copy and fp32 master) is snapshotted before a round, which costs 4-6
bytes x parameters / world for the duration of the schedule.

`metric_fn` must score a split the calibration set and the final evaluation never touch
(a validation split), lower is better (loss or perplexity), and be collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.config import PruneConfig
from harness.distributed import Collectives
from harness.pruning.calibration import LossFn
from harness.pruning.pipeline import PruneReport, run_pruning
from harness.pruning.shards import build_views, restore_views, snapshot_views


@dataclass
class ScheduleReport:
    baseline: float
    rounds: list[tuple[float, float, float]] = field(default_factory=list)  # (target, achieved, metric)
    accepted: PruneReport | None = None  # the last round kept (None: even the first was too costly)
    stopped_at: float | None = None  # the target that broke the limit, if any


def run_schedule(
    model_or_engine: Any,
    calib_batches: Iterable[Any],
    cfg: PruneConfig,
    loss_fn: LossFn,
    metric_fn: Callable[[Any], float],
    targets: list[float],
    max_increase: float,
    *,
    comm: Collectives | None = None,
    **kwargs: Any,
) -> ScheduleReport:
    """Prune at each sparsity of `targets` (increasing) until the metric limit is hit."""
    if cfg.pattern != "unstructured":
        raise ValueError("an iterative schedule raises an unstructured target; N:M fixes the sparsity")
    if any(b <= a for a, b in zip(targets, targets[1:])):
        raise ValueError(f"schedule targets must increase, got {targets}")
    comm = comm or Collectives()
    batches = list(calib_batches)
    views = build_views(model_or_engine, cfg.targets, comm)

    def metric() -> float:
        value = torch.tensor([float(metric_fn(model_or_engine))], dtype=torch.float64)
        return float(comm.all_reduce_sum(value)[0]) / comm.world  # identical decision on every rank

    report = ScheduleReport(baseline=metric())
    prior = None
    for target in targets:
        snap = snapshot_views(views)
        result = run_pruning(model_or_engine, batches, dataclasses.replace(cfg, sparsity=target), loss_fn, comm=comm, prior=prior, **kwargs)
        value = metric()
        report.rounds.append((target, result.achieved_sparsity, value))
        if value > report.baseline * (1.0 + max_increase):
            restore_views(views, snap, comm)
            report.stopped_at = target
            break
        report.accepted, prior = result, result.masks
        del snap
    return report
