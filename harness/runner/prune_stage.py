"""Pruning as a stage of a run: after training (`harness.train`), or on a loaded model
(`python -m harness.prune`).

`run_prune_stage` draws the calibration set from the data's `calib` split (disjoint by
document from train and eval), runs `harness.pruning` on the trainer's own engine (any
strategy, any world size), measures eval perplexity before and after on the `eval` split,
logs per-layer sparsity, saves the masks and hands back a callable that keeps pruned
weights at exactly zero through further steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from harness.checkpoint import CheckpointManager, ResumeState
from harness.config import PruneConfig, RunConfig, needs_calibration
from harness.data import PackedData
from harness.distributed import Collectives, DistInfo
from harness.engine import Engine
from harness.errors import ConfigError, StopRequested
from harness.log import get_logger
from harness.observability import Observer
from harness.pruning import (
    ExpertReport,
    LayerReport,
    MaskEnforcer,
    MaskSet,
    PruneReport,
    build_views,
    calibration_samples,
    prune_experts,
    run_pruning,
    run_schedule,
    shard_calibration,
)
from harness.reliability import signal_received, steps_begin
from harness.runner.trainer import evaluate

log = get_logger(__name__)

MASKS_DIR = "prune_masks"  # under output_dir: MaskSet files, loadable at any world size
REPORT_FILE = "prune_report.json"  # under output_dir: the stats of the stage (rank 0)
HOLDOUT_SPLIT = "calib_holdout"  # calib-split blocks not drawn for calibration: the schedule's metric


class PruneStats(dict):
    """The stage's numbers (a plain dict: logged, returned, written as JSON) and its masks. The
    masks stay enforced through every later step by a post-step hook on the engine
    (`Engine.register_post_step_hook`) until `release()`."""

    def __init__(self, values: dict[str, Any], masks: MaskSet | None = None, hook: Any = None, experts: ExpertReport | None = None) -> None:
        super().__init__(values)
        self.masks = masks
        self._hook = hook
        self.experts = experts  # expert pruning's choice, routed around until `release()`

    def release(self) -> None:
        """Stop enforcing (removes the hook); for callers that prune the same engine again."""
        if self._hook is not None:
            self._hook.remove()
        self._hook = None
        if self.experts is not None and self.experts.mask is not None:
            self.experts.mask.remove()


# ----------------------------------------------------------------------------- calibration data


def calibration_split(data: PackedData, cfg: RunConfig) -> tuple[torch.Tensor, np.ndarray]:
    """(calibration samples, held-out calib blocks). The samples are exactly
    `calibration_samples(pool, calib_samples, calib_seed)`; the rest of the same seeded
    permutation is held out for the iterative schedule's metric, so neither the schedule
    nor calibration ever reads the eval split."""
    pool = torch.from_numpy(np.asarray(data.blocks["calib"]).astype(np.int64))
    order = calibration_samples(pool, pool.shape[0], cfg.prune.calib_seed)  # the whole pool, permuted
    n = cfg.prune.calib_samples if needs_calibration(cfg.prune) else 0  # a method that reads no data draws none
    if n > pool.shape[0]:
        raise ConfigError(
            f"prune.calib_samples={n} but the calib split has {pool.shape[0]} blocks of {cfg.data.seq_len} tokens; "
            "lower it or raise data.calib_fraction"
        )
    return order[:n], order[n:].numpy().astype(np.int32)


def calibration_batches(samples: torch.Tensor, cfg: RunConfig, info: DistInfo, comm: Collectives) -> list[torch.Tensor]:
    """This rank's micro-batches: a probe step is `grad_accum` micro-batches per rank, laid out
    so the same global micro-batches meet in the same step at any world size."""
    if samples.shape[0] == 0:
        return []
    return [b.to(info.device) for b in shard_calibration(samples, cfg.micro_batch_size, cfg.grad_accum, comm)]


# ----------------------------------------------------------------------------- the stage


def run_prune_stage(
    engine: Engine,
    data: PackedData,
    cfg: RunConfig,
    info: DistInfo,
    observer: Observer | None = None,
    step: int = 0,
    *,
    ckpt: CheckpointManager | None = None,
    resumed: ResumeState | None = None,
) -> PruneStats:
    """Prune `engine`'s model per `cfg.prune`, measure, log, save the masks and keep them enforced.

    `ckpt` (a CheckpointManager) receives the masks so later checkpoints carry them; a run
    `resumed` from such a checkpoint gets its masks back instead of being pruned twice. Collective.
    """
    steps_begin()  # a stop from here ends the pruning at a calibration step all ranks agree on
    comm = Collectives()
    if resumed is not None and resumed.masks:
        return _restore(engine, cfg.prune, info, resumed.masks, ckpt, comm)
    before = evaluate(engine, data, cfg, info)
    with _stopped_with_advice(ckpt, step):
        stats, report, experts = prune_and_measure(engine, data, cfg, info, before, comm)
    if experts is not None and ckpt is not None:
        ckpt.register_kept_experts(experts.kept)  # the export drops the others
    hook = None
    if report is not None:
        report.masks.save(os.path.join(cfg.output_dir, MASKS_DIR), build_views(engine, cfg.prune.targets, comm), comm)
        stats["masks_dir"] = os.path.join(cfg.output_dir, MASKS_DIR)
        hook = _enforce(engine, report.masks, cfg.prune.targets, comm)
        _hand_to_checkpoints(ckpt, report.masks, comm)
    _publish(stats, cfg, info, observer, step)
    return PruneStats(stats, None if report is None else report.masks, hook, experts)


def prune_and_measure(
    engine: Engine, data: PackedData, cfg: RunConfig, info: DistInfo, before: dict[str, float], comm: Collectives
) -> tuple[dict[str, Any], PruneReport | None, ExpertReport | None]:
    """The stage's pruning and its numbers, nothing kept: calibrate on the `calib` split, drop
    experts (`prune.experts`), prune weights (or run `prune.schedule`), evaluate after; `before`
    is the dense model's `evaluate`. Returns (the stats, the weights' report: None when none were
    pruned or a schedule accepted no round, the experts' report: routed around until its
    `mask.remove()`). Collective."""
    p = cfg.prune
    samples, holdout = calibration_split(data, cfg)
    batches = calibration_batches(samples, cfg, info, comm)
    kwargs: dict[str, Any] = dict(
        comm=comm,
        should_stop=lambda: comm.any([signal_received()])[0],  # every rank stops at the same calibration step
    )  # probe steps: the engine's accumulation; unset keys of `p`: the decision mode's (run_pruning)
    loss_fn = lambda _, batch: engine.forward_loss(batch)
    experts: ExpertReport | None = None
    report: PruneReport | None = None
    extra: dict[str, Any] = {}
    with engine.backward_without_step():  # probe backwards must not step
        if p.experts:  # first: weights are then pruned in the model that will be exported
            experts = prune_experts(engine, batches, p, loss_fn, **kwargs)
            extra["experts"] = experts.to_dict()
            if info.is_main:
                log.info(experts.summary())
        if p.prunes_weights and p.schedule:
            val = dataclasses.replace(data, blocks={**data.blocks, HOLDOUT_SPLIT: holdout})
            if holdout.shape[0] == 0:
                raise ConfigError(
                    "prune.schedule needs calib blocks beyond prune.calib_samples for its metric; lower "
                    "prune.calib_samples or raise data.calib_fraction"
                )
            metric = lambda _: evaluate(engine, val, cfg, info, split=HOLDOUT_SPLIT)["eval/loss"]
            sched = run_schedule(engine, batches, p, loss_fn, metric, list(p.schedule), p.max_metric_increase, **kwargs)
            report = sched.accepted
            extra = {
                **extra,
                "schedule": {
                    "baseline_holdout_loss": sched.baseline,
                    "stopped_at": sched.stopped_at,
                    "rounds": [list(r) for r in sched.rounds],
                },
            }
        elif p.prunes_weights:
            report = run_pruning(engine, batches, p, loss_fn, **kwargs)
    after = evaluate(engine, data, cfg, info)
    stats: dict[str, Any] = report.to_dict() if report is not None else {"method": p.method, "achieved_sparsity": 0.0, "layers": []}
    stats.update(extra)
    stats.update(
        eval_loss_before=before["eval/loss"],
        eval_perplexity_before=before["eval/perplexity"],
        eval_loss_after=after["eval/loss"],
        eval_perplexity_after=after["eval/perplexity"],
        calib_samples_used=len(batches) * cfg.micro_batch_size * info.world_size,
        calib_seed=p.calib_seed,
    )
    return stats, report, experts


@contextlib.contextmanager
def _stopped_with_advice(ckpt: CheckpointManager | None, step: int) -> Iterator[None]:
    """A stop signal during pruning ends the run there (a long prune would otherwise outlast any
    scheduler's grace period): say where a relaunch starts. `harness.train` saved the trained
    model before the stage (`CheckpointManager.ensure_saved`); `harness.prune` starts from its
    model directory, which pruning never writes."""
    try:
        yield
    except StopRequested as stop:
        if step == 0:
            where = "nothing of it was saved: a relaunch prunes again from the start"
        elif ckpt is not None and ckpt.last_step == step and ckpt.last_path:
            where = f"{ckpt.last_path} holds the model as training left it: relaunch with checkpoint.resume=auto to prune from there"
        else:
            where = f"no checkpoint of step {step} was kept (checkpoints are off): a relaunch trains again from the start"
        raise StopRequested(f"{stop}; {where}") from None


def _enforce(engine: Engine, masks: MaskSet, targets: str, comm: Collectives, now: bool = False) -> Any:
    """Keep `masks` pruned after every optimizer step of `engine` (`now`: also at once); the hook's handle."""
    enforcer = MaskEnforcer(engine, masks, targets, comm)
    if now:
        enforcer()
    return engine.register_post_step_hook(enforcer)


def _hand_to_checkpoints(ckpt: CheckpointManager | None, masks: MaskSet, comm: Collectives) -> None:
    """Later checkpoints carry the masks (a Stateful registered with the checkpoint manager)."""
    if ckpt is not None:
        ckpt.register_masks(masks, sharded=comm.world > 1)  # each rank holds its own range (world 1: the whole mask)


def _restore(
    engine: Engine, prune: PruneConfig, info: DistInfo, saved: dict[str, torch.Tensor], ckpt: CheckpointManager | None, comm: Collectives
) -> PruneStats:
    """Masks from a resumed checkpoint: enforce them again rather than pruning twice. A mask
    saved at world 1 is whole; at another world size each rank takes its range of it."""
    views = [v for v in build_views(engine, prune.targets, comm) if v.name in saved]  # what the run pruned
    masks = MaskSet.from_state(saved, views)
    counts = masks.counts(views, comm)
    total = sum(n for _, _, n in counts)
    stats = {
        "method": prune.method,
        "resumed": True,
        "achieved_sparsity": sum(k for _, k, _ in counts) / max(1, total),
        "layers": [LayerReport(name, n, k, v.target.param_name).to_dict() for v, (name, k, n) in zip(views, counts)],
    }
    hook = _enforce(engine, masks, prune.targets, comm, now=True)  # the checkpoint's weights are zero there already: by construction
    _hand_to_checkpoints(ckpt, masks, comm)
    ckpt_step = ckpt.last_path if ckpt is not None else None
    log.info(f"prune: masks restored from {ckpt_step} (sparsity {stats['achieved_sparsity']:.4f}); not pruning again")
    return PruneStats(stats, masks, hook)


def _publish(stats: dict[str, Any], cfg: RunConfig, info: DistInfo, observer: Observer | None, step: int) -> None:
    """metrics.jsonl (per-layer sparsity, before/after perplexity), the report file, one summary line."""
    if observer is not None:
        observer.log_prune(stats, step)
    if not info.is_main:
        return
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, REPORT_FILE), "w") as f:
        json.dump(stats, f, indent=1, default=str)
    weights = (
        f"{stats['method']} {cfg.prune.pattern}: sparsity {stats['achieved_sparsity']:.4f} over the pruned layers "
        f"(target {stats.get('target_sparsity', cfg.prune.sparsity):g}); "
        if cfg.prune.prunes_weights
        else "experts: "
    )
    line = f"prune {weights}eval perplexity {stats['eval_perplexity_before']:.3f} -> {stats['eval_perplexity_after']:.3f}"
    if "wall_time_s" in stats:
        line += (
            f"; {stats['wall_time_s']:.1f}s, passes fwd {stats['fwd_passes']:g} fwd+bwd {stats['fwd_bwd_passes']:g}, "
            f"K={stats['group_size']}, probe memory {stats['peak_probe_bytes'] / 2**20:.2f} MiB/rank"
        )
    if "experts" in stats:
        e = stats["experts"]
        line += f"; experts by {e['score']}: {e['kept_per_layer']} of {e['count']} kept per MoE layer"
    if "schedule" in stats:
        line += f"; schedule rounds {stats['schedule']['rounds']} stopped at {stats['schedule']['stopped_at']}"
    log.info(line)


# ----------------------------------------------------------------------------- the command
