"""Pruning: magnitude, Wanda, SparseGPT and GradProbe on sharded models.

Entry points for the trainer:
    run_pruning(model_or_engine, calib_batches, cfg.prune, loss_fn, grad_accum=...) -> PruneReport
    MaskEnforcer(model_or_engine, report.masks, cfg.prune.targets)  # call after each optimizer step
    prune_experts(model_or_engine, calib_batches, cfg.prune, loss_fn) -> ExpertReport  # whole experts
    report.masks.save(dir, views, comm) / MaskSet.load(dir, views, comm)
For measurements and tests:
    snap = snapshot_views(views); ...; restore_views(views, snap, comm)  # masks chosen, weights put back
    with recording_g0() as g0: run_pruning(...)  # GradProbe's dense-gradient statistic as computed

A method is one entry of `harness.pruning.registry` and its module.
"""

from harness.pruning.calibration import calibration_samples, shard_calibration
from harness.pruning.experts import ExpertReport, experts_to_drop, prune_experts
from harness.pruning.gradprobe import recording_g0
from harness.pruning.masks import MaskEnforcer, MaskSet
from harness.pruning.pipeline import LayerReport, PruneReport, run_pruning
from harness.pruning.schedule import ScheduleReport, run_schedule
from harness.pruning.shards import ShardView, build_views, restore_views, snapshot_views

__all__ = [
    "ExpertReport",
    "LayerReport",
    "MaskEnforcer",
    "MaskSet",
    "PruneReport",
    "ScheduleReport",
    "ShardView",
    "build_views",
    "calibration_samples",
    "experts_to_drop",
    "prune_experts",
    "recording_g0",
    "restore_views",
    "run_pruning",
    "run_schedule",
    "shard_calibration",
    "snapshot_views",
]
