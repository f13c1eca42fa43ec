"""Out of memory: what was held, by category, and the one change the planner says would fit.

An OOM is the most common way a first run of a new config dies, and the traceback alone
says only "tried to allocate 2 GiB". The report names the step, the bytes of parameters,
gradients and optimizer state this rank held (`Engine.state_bytes`), the per-category peak
of the largest step the memory tracker measured, the device's totals, and the first single
change (activation checkpointing, half the micro-batch with twice the accumulation, more
sharding, a chunked loss) whose `harness.planner` estimate fits the device. Where the planner
finds the config's activations (and the step's temporaries) most of its peak, the long-sequence
knobs follow: the tiled MLP, checkpoint-input offload (on a GPU), sequence parallelism.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch

from harness.config import ConfigError, RunConfig, Strategy, StrategyFacts, load_strategy, more_sharding
from harness.distributed import DistInfo
from harness.memory import ACTIVATION_CHECKPOINTING, CHUNKED_LOSS, advised
from harness.planner import estimate, sequence_degree
from harness.reliability.guard import StepGuard


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def _fmt(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _variant(cfg: RunConfig, change: list[tuple[str, Any]]) -> RunConfig:
    """A copy of the run config with dotted keys set (values already typed)."""
    variant = copy.deepcopy(cfg)
    for key, value in change:
        node = variant
        *parents, leaf = key.split(".")
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return variant


def resolved_strategy(strategy: str, guard: StepGuard | None = None) -> Strategy | None:
    """The strategy the run trains with: the engine's own plan where a guard knows the engine, else
    the config's (or the `accelerate launch` flags') resolved as the trainer resolves it."""
    if guard is not None:
        return guard.engine.plan.strategy
    try:
        return load_strategy(strategy)
    except ConfigError:
        return None


def candidate_changes(
    cfg: RunConfig, strategy: Strategy | None, long_sequence: bool = False, world: int = 1, target: str = "cpu"
) -> list[list[tuple[str, Any]]]:
    """Single changes that lower a step's memory, in the order they are tried. "More sharding" is
    one step further along the run's own engine (`more_sharding` of its resolved facts): a DeepSpeed
    run launched without `strategy:` is a DeepSpeed run, never told to become FSDP2. ``long_sequence``
    (activations dominate): then the long-sequence techniques their rows advise, in their table's
    order and with their values (`harness.memory.techniques`, which the ladder's rungs read too), then
    sequence parallelism (harness's Ulysses, or DeepSpeed's ALST), its accumulation
    keeping the global batch."""
    candidates: list[list[tuple[str, Any]]] = []
    if not ACTIVATION_CHECKPOINTING.is_on(cfg.memory):
        candidates.append(list(ACTIVATION_CHECKPOINTING.turn_on))
    if cfg.micro_batch_size > 1:
        candidates.append([("micro_batch_size", cfg.micro_batch_size // 2), ("grad_accum", cfg.grad_accum * 2)])
    further = more_sharding(StrategyFacts.of(strategy)) if strategy is not None else None
    if further is not None:
        candidates.append([("strategy", further)])
    if not CHUNKED_LOSS.is_on(cfg.memory):
        candidates.append(list(CHUNKED_LOSS.turn_on))
    if not long_sequence:
        return candidates
    candidates += [list(technique.turn_on) for technique in advised(cfg, target)]
    n = sequence_degree(cfg, world) if strategy is not None else 1
    if n > 1:
        candidates.append([("parallel.sequence", n), ("grad_accum", cfg.grad_accum * n)])
    return candidates


def activations_dominate(cfg: RunConfig, world: int, target: str, strategy: Strategy | None) -> bool:
    """Whether the planner puts activations and the step's temporaries at half the config's peak or more."""
    try:
        peak = estimate(cfg, world, target=target, strategy=strategy).peak.categories
    except Exception:  # no estimate of the config as run: the report's other changes still stand
        return False
    return 2 * (peak.get("activations", 0) + peak.get("temporaries", 0)) >= sum(peak.values())


def planner_suggestion(
    cfg: RunConfig, world: int, capacity: int | None, target: str, budget_s: float = 60.0, strategy: Strategy | None = None
) -> str:
    """The first single change whose estimated per-rank peak fits `capacity` (harness.planner), as overrides.
    `strategy`: the run's resolved strategy (default: `resolved_strategy(cfg.strategy)`); every change is costed
    under it, a change of strategy under the shipped strategy it names."""
    strategy = strategy or resolved_strategy(cfg.strategy)
    t0, best = time.monotonic(), None
    candidates = candidate_changes(cfg, strategy, activations_dominate(cfg, world, target, strategy), world, target)
    for change in candidates:
        if time.monotonic() - t0 > budget_s:
            break
        text = " ".join(f"{k}={v}" for k, v in change)
        changed = dict(change).get("strategy")
        try:
            under = load_strategy(changed, env={}) if changed else strategy
            peak = estimate(_variant(cfg, change), world, target=target, strategy=under).total
        except Exception:
            continue
        if capacity is not None and peak <= 0.9 * capacity:
            return f"{text} (estimated peak {_fmt(peak)} per rank, capacity {_fmt(capacity)})"
        if best is None or peak < best[1]:
            best = (text, peak)
    if best is None:
        return "no estimate available; try memory.activation_checkpointing=full, a smaller micro_batch_size or more sharding"
    return f"no single change fits; the smallest estimate is {best[0]} ({_fmt(best[1])} per rank); combine changes"


def oom_report(exc: BaseException, cfg: RunConfig, info: DistInfo, guard: StepGuard | None = None) -> str:
    """Memory held by category now, the tracker's largest measured peak, device totals, and the planner's advice.

    `cfg`: the run's resolved config (the planner costs single changes of it); `guard` knows the
    engine, the memory tracker and the step.
    """
    step = guard.steps_done + 1 if guard is not None else "?"
    lines = [f"harness: error: out of memory on rank {info.rank} ({info.device}) in step {step}: {str(exc).splitlines()[0]}"]
    if guard is not None:
        held = guard.engine.state_bytes()
        lines.append("  held now by category: " + ", ".join(f"{k} {_fmt(v)}" for k, v in held.items()))
        tracker = guard.tracker
        peaks = tracker.peak_so_far() if tracker is not None and tracker.history else {}
        if peaks:
            index = peaks.get("step")  # the tracker counts the steps of this process from 0
            step_no = guard.start_step + index + 1 if isinstance(index, int) else "?"
            lines.append(
                f"  peak of the largest measured step (step {step_no}): "
                + ", ".join(f"{k} {_fmt(v)}" for k, v in peaks.items() if k != "step" and v is not None)
            )
    capacity, target = None, "cpu"
    if info.device.type == "cuda":
        target = "cuda"
        capacity = torch.cuda.get_device_properties(info.device).total_memory
        lines.append(
            f"  device: peak allocated {_fmt(torch.cuda.max_memory_allocated(info.device))}, peak reserved "
            f"{_fmt(torch.cuda.max_memory_reserved(info.device))}, capacity {_fmt(capacity)}"
        )
    else:
        try:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local)
            lines.append(f"  host memory per local rank: {_fmt(capacity)}")
        except (ValueError, OSError):
            pass
    strategy = resolved_strategy(cfg.strategy, guard)
    lines.append("  the planner would change: " + planner_suggestion(cfg, info.world_size, capacity, target, strategy=strategy))
    return "\n".join(lines)
