"""The `Trainer`: the whole training run once it is built, readable in one sitting; and evaluation.

One `Trainer` serves training, fine-tuning after pruning (the engine's post-step hook keeps
pruned weights at zero) and `python -m harness.prune`: `train(first, stop)` runs steps, `close()` ends the
run's outputs. It never asks which engine it has.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.checkpoint import CheckpointManager
from harness.config import RunConfig
from harness.data import BatchSampler, PackedData, SequenceSlice, split_batches
from harness.distributed import Collectives, DistInfo
from harness.engine import Engine
from harness.log import get_logger
from harness.memory import COUNTER_KEYS, StepMemoryTracker
from harness.observability import PEAK_RANK, Observer
from harness.reliability import StepGuard, steps_begin
from harness.training import AUX_LOSS, RouterLoss, count_targets

log = get_logger(__name__)


def write_state_bytes(output_dir: str, info: DistInfo, points: list[dict[str, int]]) -> None:
    """Per-rank bytes held in the first step (max over its phases): the proof of sharding."""
    peak = {k: max(p[k] for p in points) for k in points[0]}
    os.makedirs(os.path.join(output_dir, "state_bytes"), exist_ok=True)
    with open(os.path.join(output_dir, "state_bytes", f"rank{info.rank}.json"), "w") as f:
        json.dump({"rank": info.rank, "world_size": info.world_size, "peak": peak, "phases": points}, f, indent=1)


def _fold(old: float | None, new: float | None) -> float | None:
    return new if old is None else old if new is None else max(old, new)


@dataclass
class MemoryPeaks:
    """This rank's memory peaks since the last log step, per key the maximum over the steps (as
    the observer folds them), reduced over ranks only when a log step writes them: memory
    reporting's one collective runs at log steps, not every step."""

    peaks: dict[str, float | None] = field(default_factory=dict)
    maxima: dict[str, float | None] = field(default_factory=dict)

    def add(self, tracker: StepMemoryTracker) -> None:
        for folded, step in ((self.peaks, tracker.last_peaks()), (self.maxima, tracker.last_category_maxima())):
            for k, v in step.items():
                folded[k] = _fold(folded.get(k), v)

    def reduce(self, comm: Collectives) -> dict[str, float | None]:
        """The interval's memory on the rank that peaked highest (collective when tracking is on).

        `_peak_bytes`: that rank's split at its peak (sums to its total; the stacked panel);
        `_max_bytes`: each category's own maximum over every rank; `memory/peak_rank`: which
        rank. Ranks differ (uneven shards, rank 0's extra buffers): one rank's view understates.
        """
        peaks, maxima = self.peaks, self.maxima
        self.peaks, self.maxima = {}, {}
        out: dict[str, float | None] = {}
        if peaks and comm.distributed:
            gathered = comm.gather_object((peaks, maxima))
            # the split's total where every rank split in the interval, else the peak counter all ranks read
            key = next((k for k in ("total", *COUNTER_KEYS) if all(k in g[0] for g in gathered)), "total")
            worst = max(range(len(gathered)), key=lambda r: gathered[r][0].get(key) or 0)
            peaks = gathered[worst][0]
            maxima = {k: max((g[1].get(k) or 0) for g in gathered) for k in maxima}
            out[PEAK_RANK] = worst
        out.update({f"memory/{k}_peak_bytes": v for k, v in peaks.items()})
        out.update({f"memory/{k}_max_bytes": v for k, v in maxima.items()})
        return out


def evaluate(engine: Engine, data: PackedData, cfg: RunConfig, info: DistInfo, split: str = "eval") -> dict[str, float]:
    """Mean token loss and perplexity over the same global set of blocks at any world size:
    every rank's summed token losses and counted tokens, summed over ranks, then divided (under
    sequence parallelism each rank its slice of its group's blocks: each token counted once)."""
    engine.train(False)
    total, count = 0.0, 0.0
    piece, world, rank = SequenceSlice.of(engine.plan.layout, info.rank)
    for batch, counted in split_batches(data, split, cfg.micro_batch_size, cfg.eval_batches, world, rank, piece):
        loss_sum = float(engine.eval_loss_sum(batch.to(info.device)))  # a filler's forward still runs: sharded engines gather in it
        if counted:
            total += loss_sum
            count += count_targets(batch)
    total, count = Collectives().sum([total, count])
    engine.train(True)
    mean = total / max(count, 1.0)
    return {"eval/loss": mean, "eval/perplexity": math.exp(min(mean, 50.0))}


def tokens_per_micro_batch(batches: list[torch.Tensor], comm: Collectives) -> float:
    """The step's counted tokens (all its micro-batches, all ranks) per micro-batch.

    Each micro-batch's loss is its summed token losses divided by this; the engines then
    average over accumulation and ranks, so the step's loss and gradient weigh every counted
    token of the step equally, however the global batch is split (HF Trainer's
    `num_items_in_batch` with `average_tokens_across_devices`). With uneven label counts
    (instruction data) a per-micro-batch mean would not: each micro-batch would weigh the same.

    Text blocks count every target, so every rank counts the same (its batches' shape): the sum
    over ranks is known without a collective. Labelled blocks differ by rank: summed (collective).
    """
    local = float(sum(count_targets(b) for b in batches))
    total = local * comm.world if all(b.dim() == 2 for b in batches) else comm.sum([local])[0]
    return max(total, 1.0) / (len(batches) * comm.world)


@dataclass
class Trainer:
    """Everything the steps touch, so one trainer serves training, fine-tuning after pruning
    (the engine's post-step hook keeps pruned weights at zero) and `python -m harness.prune`."""

    cfg: RunConfig
    info: DistInfo
    engine: Engine
    data: PackedData
    sampler: BatchSampler
    observer: Observer
    tracker: StepMemoryTracker
    guard: StepGuard
    ckpt: CheckpointManager
    skipped: int = 0
    loss_mean: float = float("nan")
    aux_loss: float = float("nan")  # the last step's router load-balancing loss (train/aux_loss; nan: no router)
    stopped_at: int | None = None  # the step a stop request ended the run at (checkpoint saved)
    before_step: Callable[[int], None] | None = None  # run with the step's reduced gradients, before engine.step() (the check's recorder)
    started_at: float | None = None  # time.perf_counter() when the run began building: time to first step is part of its cost
    comm: Collectives = field(default_factory=Collectives)  # the counted tokens and memory peaks over ranks
    memory: MemoryPeaks = field(default_factory=MemoryPeaks)  # this rank's peaks since the last log step
    router: RouterLoss | None = None  # a mixture-of-experts router's loss, in the loss function: its step's values to log

    def train(self, first: int, stop: int) -> bool:
        """Train steps [first, stop); False when a stop request ended the run (saved, observer closed)."""
        cfg, info, engine, sampler, tracker, guard, observer = (
            self.cfg,
            self.info,
            self.engine,
            self.sampler,
            self.tracker,
            self.guard,
            self.observer,
        )
        steps_begin()  # a stop from here is acted on at a step boundary, with a checkpoint
        tokens_per_step = sampler.global_batch * cfg.data.seq_len
        engine.train(True)
        state_points: list[dict[str, int]] = []
        router = self.router
        if router is not None:
            router.pop()  # what forwards outside training recorded (pruning's probes) is not this run's step
        for step in range(first, stop):
            t0 = time.perf_counter()
            with tracker.step():
                loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)  # read once, by the agreement
                batches = [sampler.batch(step, micro) for micro in range(cfg.grad_accum)]
                per_micro = tokens_per_micro_batch(batches, self.comm)
                for micro, batch in enumerate(batches):
                    last = micro == cfg.grad_accum - 1
                    with engine.micro_batch(last):  # only the last one reduces gradients over ranks
                        loss = engine.forward_loss(batch.to(info.device, non_blocking=True), num_items=per_micro)
                        engine.backward(loss, last_micro=last)
                    loss_sum += loss.detach().double() / cfg.grad_accum
                    if step == 0:
                        state_points.append(engine.state_bytes())
                lr = engine.lr
                if self.before_step is not None:  # sees the reduced gradients as backward left them (the check)
                    self.before_step(step)
                routed = router.pop() if router is not None else None  # [aux loss, expert counts] summed over micro-batches
                if routed is not None and router is not None and router.coef:  # train/loss: the language model's (eval's)
                    loss_sum -= router.coef * routed[0] / cfg.grad_accum
                # the step's one host sync: every rank agrees on a non-finite loss or gradient and a stop request
                agreed = guard.agree(loss_sum, engine.grad_norm(), routed)
                result = engine.step(skip=agreed.skip)  # and its post-step hooks (`Engine.register_post_step_hook`)
            if step == 0:
                state_points.append(engine.state_bytes())
                write_state_bytes(cfg.output_dir, info, state_points)
            elapsed = time.perf_counter() - t0
            self.skipped += int(result.skipped)
            guard.post_step(result)  # checkpoint.on_nonfinite: skip (counted) or stop naming the last good checkpoint
            self.loss_mean = agreed.loss
            metrics = {
                "train/loss": self.loss_mean,
                "train/lr": lr,
                "train/grad_norm": result.grad_norm,  # a device tensor the observer reads at the log step
                "train/skipped_steps": self.skipped,
                "perf/step_time_s": elapsed,
                "perf/tokens_per_s": tokens_per_step / elapsed,
                "perf/samples_per_s": sampler.global_batch / elapsed,
            }
            if router is not None:  # train/aux_loss and each layer's expert load, over the step's micro-batches and ranks
                metrics.update(router.step_metrics(agreed.extra, cfg.grad_accum * self.comm.world))
                self.aux_loss = metrics.get(AUX_LOSS, self.aux_loss)
            self.memory.add(tracker)
            evaluate_now = bool(cfg.eval_every) and (step + 1) % cfg.eval_every == 0 and step + 1 < stop and self.data.n_blocks("eval") > 0
            if (step + 1) % cfg.logging.log_every == 0 or step + 1 == stop or evaluate_now or guard.stop_requested:
                metrics.update(self.memory.reduce(self.comm))  # a log step, or the interval ends here
            if step == first and self.started_at is not None:
                metrics["time/to_first_step_s"] = time.perf_counter() - self.started_at
                startup = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in engine.startup_s.items())
                log.info(f"time to first step: {metrics['time/to_first_step_s']:.1f} s ({startup}, then restore and the first step)")
            observer.log_step(step + 1, metrics)
            if evaluate_now:
                observer.log_eval(step + 1, evaluate(engine, self.data, cfg, info))
            if self.ckpt.after_step(step + 1, {"skipped_steps": self.skipped}, stop=guard.stop_requested):
                self.close()  # SIGTERM/SIGUSR1: saved; exit cleanly so the job can requeue
                self.stopped_at = step + 1
                return False
        guard.finish(stop - first)  # nothing trained (every step skipped as non-finite): exit 3, not 0
        return True

    def close(self) -> None:
        """End the run's outputs (metrics, W&B, plots): after the summary is logged."""
        self.observer.close()
