"""Train a causal LM under any strategy: the recipe, readable end to end.

    accelerate launch harness/train.py --config <file> [key=value ...]
    deepspeed --num_gpus=8 harness/train.py --config <file> [key=value ...]
    torchrun --nproc_per_node=2 harness/train.py --config <file>
    python -m harness.train --config <file>
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a file by a launcher: make `harness` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from harness import distributed as dist_utils
from harness.config import ConfigError, RunConfig, config_to_dict, load_config
from harness.data import BatchSampler, PackedData, load_packed, prepare_data, split_batches
from harness.engine import Engine
from harness.models import build_model, count_parameters
from harness.parallelize import build_engine
from harness.precision import precision_policy
from harness.state_bytes import engine_state_bytes
from harness.strategies import Strategy, load_strategy


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="harness.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="run config (YAML or JSON); omitted: the embedded default")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return parser.parse_known_args(argv)


def prepare(cfg: RunConfig, info: dist_utils.DistInfo) -> PackedData:
    """Rank 0 tokenizes and packs into the cache while the others wait, then all load it."""
    if info.is_main:
        prepare_data(cfg.model.name, cfg.data)
    if info.distributed:
        torch.distributed.barrier()
    return load_packed(prepare_data(cfg.model.name, cfg.data))  # cached: returns at once


def write_state_bytes(output_dir: str, info: dist_utils.DistInfo, points: list[dict[str, int]]) -> None:
    """Per-rank bytes held in the first step (max over its phases): the proof of sharding."""
    peak = {k: max(p[k] for p in points) for k in points[0]}
    os.makedirs(os.path.join(output_dir, "state_bytes"), exist_ok=True)
    with open(os.path.join(output_dir, "state_bytes", f"rank{info.rank}.json"), "w") as f:
        json.dump({"rank": info.rank, "world_size": info.world_size, "peak": peak, "phases": points}, f, indent=1)


def evaluate(engine: Engine, data: PackedData, cfg: RunConfig, info: dist_utils.DistInfo, split: str = "eval") -> dict[str, float]:
    """Mean token loss and perplexity over the same global set of blocks at any world size."""
    engine.train(False)
    total, count = 0.0, 0.0
    for batch in split_batches(data, split, cfg.micro_batch_size, cfg.eval_batches, info.world_size, info.rank):
        loss = engine.eval_loss(batch.to(info.device))
        total += float(loss) * batch.shape[0]
        count += batch.shape[0]
    total, count = dist_utils.all_reduce_sum([total, count], info)
    engine.train(True)
    if engine.kind == "fsdp":  # a no-grad forward leaves reshard_after_forward=False groups unsharded: their
        from torch.distributed.fsdp import FSDPModule  # parameters would not be the optimizer's (checkpoint save fails)

        for module in engine.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    mean = total / max(count, 1.0)
    return {"eval/loss": mean, "eval/perplexity": math.exp(min(mean, 50.0))}


@dataclass
class Loop:
    """Everything the steps touch, so one loop serves training, fine-tuning after pruning
    (`after_step` keeps pruned weights at zero) and `python -m harness.prune`."""

    cfg: RunConfig
    info: dist_utils.DistInfo
    engine: Engine
    data: PackedData
    sampler: BatchSampler
    observer: Any
    tracker: Any
    guard: Any
    ckpt: Any
    skipped: int = 0
    loss_mean: float = float("nan")
    stopped_at: int | None = None  # the step a stop request ended the run at (checkpoint saved)
    after_step: Callable[[], None] | None = None  # run after every engine.step(), e.g. harness/prune.py's mask enforcer

    def run(self, first: int, stop: int) -> bool:
        """Train steps [first, stop); False when a stop request ended the run (saved, observer closed)."""
        cfg, info, engine, sampler, tracker, guard, observer = self.cfg, self.info, self.engine, self.sampler, self.tracker, self.guard, self.observer
        tokens_per_step = sampler.global_batch * cfg.data.seq_len
        engine.train(True)
        state_points: list[dict[str, int]] = []
        for step in range(first, stop):
            t0 = time.perf_counter()
            with tracker.step():
                step_loss = 0.0
                for micro in range(cfg.grad_accum):
                    batch = sampler.batch(step, micro).to(info.device)
                    loss = engine.forward_loss(batch)
                    engine.backward(loss, last_micro=micro == cfg.grad_accum - 1)
                    step_loss += float(loss.detach()) / cfg.grad_accum
                    if step == 0:
                        state_points.append(engine_state_bytes(engine))
                lr = engine.lr
                result = engine.step(skip=guard.pre_step(step_loss))  # all ranks agree on a non-finite loss first
                if self.after_step is not None:
                    self.after_step()
            if step == 0:
                state_points.append(engine_state_bytes(engine))
                write_state_bytes(cfg.output_dir, info, state_points)
            elapsed = time.perf_counter() - t0
            self.skipped += int(result.skipped)
            guard.post_step(result)  # checkpoint.on_nonfinite: skip (counted) or stop naming the last good checkpoint
            self.loss_mean = dist_utils.all_reduce_mean(step_loss, info)
            metrics = {
                "train/loss": self.loss_mean, "train/lr": lr, "train/grad_norm": result.grad_norm, "train/skipped_steps": self.skipped,
                "perf/step_time_s": elapsed, "perf/tokens_per_s": tokens_per_step / elapsed,
                "perf/samples_per_s": sampler.global_batch / elapsed,
            }
            # `_peak_bytes`: the split at the step's peak moment (sums to the total; the stacked
            # panel); `_max_bytes`: each category's own maximum in the step.
            metrics.update({f"memory/{k}_peak_bytes": v for k, v in tracker.last_peaks().items()})
            metrics.update({f"memory/{k}_max_bytes": v for k, v in tracker.last_category_maxima().items()})
            observer.log_step(step + 1, metrics)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < stop:
                observer.log_eval(step + 1, evaluate(engine, self.data, cfg, info))
            if self.ckpt.after_step(step + 1, {"skipped_steps": self.skipped}, stop=guard.stop_requested):
                observer.close()  # SIGTERM/SIGUSR1: saved; exit cleanly so the job can requeue
                self.stopped_at = step + 1
                return False
        return True


def build_run(cfg: RunConfig, strategy: Strategy, info: dist_utils.DistInfo) -> tuple[Loop, Any]:
    """Data, model, engine, checkpoint restore, observer: everything before the first step
    (shared with `python -m harness.prune`). Returns the loop and the restored state."""
    from harness.loss import causal_lm_loss
    from harness.memory_tracking import StepMemoryTracker
    from harness.observability.observer import Observer
    from harness.checkpoint import CheckpointManager
    from harness.failures import StepGuard

    torch.manual_seed(cfg.seed)
    data = prepare(cfg, info)
    model = build_model(cfg.model.name, vocab_size=data.vocab_size, seed=cfg.model.seed)
    policy = precision_policy(cfg.precision, info.device, strategy.kind)
    loss_fn = functools.partial(causal_lm_loss, chunk_size=cfg.memory.loss_chunk_size)
    engine = build_engine(model, cfg, strategy, policy, info, loss_fn)
    ckpt = CheckpointManager(cfg, strategy, info, engine, tokenizer_dir=data.tokenizer_dir)  # harness/checkpoint.py
    resumed = ckpt.restore()  # step 0, or the checkpoint's step (= data position) with optimizer, RNG, schedule
    sampler = BatchSampler(data, cfg.micro_batch_size, cfg.grad_accum, info.world_size, info.rank, cfg.data.seed)
    observer = Observer(cfg.output_dir, config_to_dict(cfg), cfg.logging, info.rank, info.world_size, cfg.steps,
                        model_config=engine.module.config, start_step=resumed.step)
    tracker = StepMemoryTracker(
        engine.model, engine.optimizer, enabled=cfg.memory.track, category_every=cfg.memory.track_every,
        snapshot_dir=os.path.join(cfg.output_dir, "memory_snapshot") if cfg.memory.snapshot else None,
        layer_hooks=cfg.memory.layer_hooks,
    )
    guard = StepGuard(cfg, info, engine, tracker, lambda: ckpt.last_path, resumed.step)  # NaN policy, stop signals: harness/failures.py
    if info.is_main:
        print(f"[harness] {strategy.name} ({strategy.kind}) x{info.world_size} on {info.device}, {cfg.precision}, "
              f"{count_parameters(engine.module) * (1 if not strategy.shards_params else info.world_size):,} params, "
              f"global batch {sampler.global_batch} x {cfg.data.seq_len} tokens", flush=True)
    loop = Loop(cfg, info, engine, data, sampler, observer, tracker, guard, ckpt, skipped=int(resumed.counters.get("skipped_steps", 0)))
    return loop, resumed


def train(cfg: RunConfig, strategy: Strategy, info: dist_utils.DistInfo) -> dict[str, float]:
    loop, resumed = build_run(cfg, strategy, info)
    engine, data, observer, ckpt = loop.engine, loop.data, loop.observer, loop.ckpt
    last = cfg.steps
    if not loop.run(resumed.step, cfg.steps):
        return {"preempted_at_step": loop.stopped_at, "skipped_steps": loop.skipped}
    if cfg.prune.method != "none":  # prune, then fine-tune with the masks enforced: harness/prune.py
        from harness.prune import run_prune_stage

        loop.after_step = run_prune_stage(engine, data, cfg, info, observer, cfg.steps, ckpt=ckpt, resumed=resumed).after_step
        last = cfg.steps + cfg.prune.finetune_steps
        if not loop.run(max(resumed.step, cfg.steps), last):
            return {"preempted_at_step": loop.stopped_at, "skipped_steps": loop.skipped}
    final = evaluate(engine, data, cfg, info)
    observer.log_eval(last, final)
    summary = {"final_train_loss": loop.loss_mean, "final_eval_loss": final["eval/loss"], "final_eval_perplexity": final["eval/perplexity"], "skipped_steps": loop.skipped}
    ckpt.finish(last, {"skipped_steps": loop.skipped})  # the final checkpoint and HF export, if configured
    observer.log_summary(summary)
    observer.close()
    if info.is_main:
        print(f"[harness] final eval perplexity {final['eval/perplexity']:.2f}; outputs in {os.path.abspath(cfg.output_dir)}", flush=True)
    return summary


def run_command(prog: str, load: Callable[[], tuple[RunConfig, Strategy]], body: Callable[..., Any]) -> int:
    """Shared by `harness.train` and `harness.prune`: every check that can fail runs in `load`,
    before any process group starts (one line, exit 2); then `body(cfg, strategy, info)` runs
    under the supervisor (OOM, dead ranks, NaN stop, SIGTERM -> a message and an exit code)."""
    try:
        cfg, strategy = load()
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from harness.failures import Supervisor, collective_timeout_s

    info = dist_utils.init_distributed(cfg.device, collective_timeout_s(), force_group=strategy.needs_process_group)
    try:
        with Supervisor(cfg, info):
            body(cfg, strategy, info)
    finally:
        dist_utils.teardown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)

    def load() -> tuple[RunConfig, Strategy]:
        from harness.preflight import preflight

        cfg = load_config(args.config, overrides)
        strategy = load_strategy(cfg.strategy)
        preflight(cfg, strategy)
        return cfg, strategy

    return run_command("harness", load, train)


if __name__ == "__main__":
    from harness.distributed import exit_process

    exit_process(main())
