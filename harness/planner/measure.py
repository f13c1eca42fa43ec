"""The ground truth the planner is judged against: real training steps, real bytes.

A real run of a config (real CPU tensors, a real gloo process group, the trainer's own
engine from ``harness.engine.build_engine`` and its own loss) is measured with
torch's ``MemTracker`` (``harness.memory.FrozenAwareMemTracker``: one that accepts a frozen
LoRA base) entered *before* the model is built. That way every storage the
process allocates is followed - module parameters, DDP buckets, DeepSpeed's flat
buffers, master copies and gradient partitions - which is what ``max_memory_allocated``
counts on a GPU. The peak is taken per step (the tracker's peak is re-armed at each
step), on the training device only (DeepSpeed keeps shape-only "meta" tensors that hold
no memory).

Two cases MemTracker cannot measure are measured by the CPU allocator's own running account
(``harness.memory.AllocatorTrace``, entered before the model too): a step whose optimizer compiles
itself (torchao's, compiled with ``fullgraph=True``, which a dispatch mode breaks), always; and, on
request (``allocator``), any run, beside MemTracker: it also sees what a custom op's kernel or a
tensor subclass allocates below the dispatcher (bitsandbytes' CPU 8-bit step, torchao's quantized
states run eager). The first case is split by category as the trainer splits it (saved tensors,
gradient hooks, state counted: each category's own maximum, no common instant).

After the measured steps one more step is measured by the trainer's own
``StepMemoryTracker`` (``harness.memory.tracking``), so the two measurements can be set
side by side; the trainer's tracker counts a buffer allocated before the step only once
the step touches it.

Run on each rank by ``torchrun`` (see :func:`launch`); results come back as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from harness import imports_done  # the package first: as the program, the imports below run with the collector held

# isort: split
import torch
import torch.distributed as dist

from harness.config import ParallelLayout, aux_loss_coefficient, load_config, load_strategy
from harness.data import SequenceSlice
from harness.distributed import CollectiveBytes, free_port, init_distributed, teardown
from harness.engine import build_engine, hidden_size_of, plan_engine
from harness.memory import CATEGORIES as CATS
from harness.memory import AllocatorTrace, FrozenAwareMemTracker, StepMemoryTracker, category_of
from harness.models import model_spec
from harness.training import IGNORE_INDEX, RouterLoss, loss_for, name_compiles_step


def cpu_categories(snap: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """A MemTracker snapshot's CPU bytes in harness's categories (`harness.memory.CATEGORIES`), with
    their ``total``: the measurement's unit, public so that a study tracking a step its own way
    (an instrumented tracker, a variant of the model) counts exactly as the planner's judge does."""
    out = dict.fromkeys(CATS, 0)
    for dev, cats in snap.items():
        if dev.type != "cpu":
            continue
        for reftype, nbytes in cats.items():
            cat = category_of(reftype)
            if cat is not None:
                out[cat] += nbytes
    out["total"] = sum(out[c] for c in CATS)
    return out


def measure_config(
    overrides: list[str],
    steps: int = 3,
    vocab_size: int | None = None,
    trainer_view: bool = True,
    allocator: bool = False,
    dispatch: bool = True,
) -> dict[str, Any]:
    """Build the run's engine on this rank and measure ``steps`` steps; the process group must be up.

    ``allocator``: also keep the CPU allocator's account (`AllocatorTrace`), which sees what a
    custom op or a tensor subclass allocates below MemTracker (``allocator_peak``). A run whose
    optimizer compiles its own step (torchao's, `harness.training.name_compiles_step`) is always
    measured that way: MemTracker's dispatch mode would break the compiled step (torchao compiles
    with ``fullgraph=True``), so there the step runs outside it, as the trainer's tracker does it
    (`StepMemoryTracker`'s saved-tensors/LiveBytes split gives the categories it can see) and the
    total is the allocator's. ``dispatch=False`` (with ``allocator``) measures every run that way:
    MemTracker's dispatch mode about doubles a step's time, the allocator's account does not.
    """
    cfg = load_config(None, overrides)
    strategy = load_strategy(cfg.strategy)
    info = init_distributed("cpu", force_group=strategy.needs_process_group)
    # under sequence parallelism a group of ranks shares its samples, each rank training its slice
    piece, _, data_rank = SequenceSlice.of(ParallelLayout.of(cfg.parallel, info.world_size), info.rank)
    gen = torch.Generator().manual_seed(1000 + data_rank)
    compiled_step = name_compiles_step(cfg.optim.name)
    live_split = compiled_step or (allocator and not dispatch)  # the step outside MemTracker, the total the allocator's
    per_step: list[dict[str, int]] = []
    sent: list[dict[str, int]] = []  # per step: bytes this rank sent by collective kind, in the micro-batches' forward and backward
    with AllocatorTrace() if allocator or compiled_step else contextlib.nullcontext() as trace:
        tracker = FrozenAwareMemTracker()  # torch's MemTracker, which refuses a frozen parameter (a LoRA base)
        with tracker:
            spec = model_spec(cfg.model.name, vocab_size=vocab_size, seed=cfg.model.seed)
            vocab = int(spec.config.vocab_size)
            plan = plan_engine(cfg, strategy, info.world_size, info.device, hidden_size_of(spec.config))
            cfg = plan.config  # as the run resolves it (a DeepSpeed file's own numbers taken in)
            packed = cfg.data.packs_examples
            base_loss = loss_for(plan.layout.splits_sequences, packed)
            router = RouterLoss(aux_loss_coefficient(cfg.moe))  # the trainer's router loss (`harness.runner.build`)
            loss_fn = lambda m, ids: base_loss(m, ids, chunk_size=cfg.memory.loss_chunk_size, router=router)
            engine = build_engine(spec, cfg, plan, info, loss_fn)
            router.attach(engine.module, engine.sequence_group)
            make = packed_rows if packed else lambda b, s, v, g: torch.randint(0, v, (b, s), generator=g)
            batches = [piece(make(cfg.micro_batch_size, cfg.data.seq_len, vocab, gen)) for _ in range(cfg.grad_accum)]
        # The trainer's split of a compiling step (saved tensors, gradient hooks, state counted), every step.
        split = (
            StepMemoryTracker(engine.model, engine.optimizer, category_every=1, storage=engine.memory_storage(), compiled=True)
            if live_split
            else None
        )
        for _ in range(steps):
            if trace is not None:
                trace.start_window()
            traffic = CollectiveBytes()
            if split is not None:
                with split.step():
                    run_step(engine, batches, tracker=None, traffic=traffic)
                per_step.append({**{k: v or 0 for k, v in split.last_category_maxima().items()}, "total": 0})
            else:
                tracker.reset_mod_stats()
                with tracker:
                    run_step(engine, batches, tracker, traffic=traffic)
                per_step.append(cpu_categories(tracker.get_tracker_snapshot("peak")))
            sent.append(dict(traffic.sent))
            if trace is not None:
                trace.end_window()
    allocator_peaks = trace.window_peaks() if trace is not None else None
    if live_split and allocator_peaks is not None:
        for s, total in zip(per_step, allocator_peaks):
            s["total"] = total
    trainer_peak, trainer_error = _trainer_view_step(engine, batches) if trainer_view else (None, None)
    best = max(per_step, key=lambda s: s["total"])
    result = {
        "overrides": overrides,
        "rank": info.rank,
        "world_size": info.world_size,
        "method": "allocator" if live_split else "memtracker",
        "peak": best["total"],
        "peak_by_category": best,
        "per_step": [s["total"] for s in per_step],
        # per step: bytes this rank sent by collective kind (DDP's second step also broadcasts its rebuilt bucket order)
        "sent_bytes": sent,
        "allocator_peak": max(allocator_peaks) if allocator_peaks else None,
        "allocator_per_step": allocator_peaks,
        "trainer_tracker_peak": trainer_peak,
        "trainer_tracker_error": trainer_error,
    }
    del engine, tracker, split
    gc.collect()
    return result


def packed_rows(rows: int, seq_len: int, vocab: int, gen: torch.Generator, examples: int = 4) -> torch.Tensor:
    """`(rows, 3, seq_len)` packed instruction blocks as `harness.data.instructions` makes them:
    ``examples`` back to back in each row, positions restarting at each, the first half of each
    (its prompt) unlabelled. What the real run's attention mask is made from."""
    ids = torch.randint(0, vocab, (rows, seq_len), generator=gen)
    width = -(-seq_len // examples)
    positions = (torch.arange(seq_len) % width).expand(rows, -1)
    labels = ids.masked_fill(positions < width // 2, IGNORE_INDEX)
    return torch.stack([ids, labels, positions], dim=1).contiguous()


def run_step(engine: Any, batches: list[torch.Tensor], tracker: Any = None, traffic: CollectiveBytes | None = None) -> None:
    """One training step as the measurement runs it: every micro-batch's forward and backward
    through the engine, then the optimizer step. ``tracker``: the MemTracker around the step, whose
    module statistics are re-armed between micro-batches (it refuses a module's second forward);
    ``traffic``: counts the collectives of the forwards and backwards (the optimizer step's norm, a
    few scalars, is not counted, nor planned). Each micro-batch inside `Engine.micro_batch`, as the
    trainer runs it: under DDP only the last one all-reduces."""
    for micro, batch in enumerate(batches):
        if micro and tracker is not None:
            tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise
        last = micro == len(batches) - 1
        with traffic if traffic is not None else contextlib.nullcontext(), engine.micro_batch(last):
            loss = engine.forward_loss(batch)
            engine.backward(loss, last_micro=last)
        del loss
    engine.step()


def _trainer_view_step(engine: Any, batches: list[torch.Tensor]) -> tuple[int | None, str | None]:
    """One more step, measured by the trainer's own ``StepMemoryTracker``: (peak total, error)."""

    view = StepMemoryTracker(engine.model, engine.optimizer, enabled=True, storage=engine.memory_storage())
    try:
        with view.step():
            run_step(engine, batches, tracker=None)
    except NotImplementedError as exc:  # MemTracker refusing a second forward of a module
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return view.last_peaks().get("total"), None


def _main(argv: list[str] | None = None) -> int:
    """Per-rank entry for torchrun: measure each config in turn, rank 0 writes all ranks' results."""
    parser = argparse.ArgumentParser(prog="harness.planner.measure")
    parser.add_argument("--runs", required=True, help="JSON file: a list of override lists")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--no-trainer-view", action="store_true", help="skip the extra step measured by the trainer's tracker")
    parser.add_argument("--allocator", action="store_true", help="also record the CPU allocator's peak (torch.profiler)")
    parser.add_argument("--no-dispatch", action="store_true", help="with --allocator: no MemTracker around the steps (faster)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    with open(args.runs) as f:
        runs = json.load(f)

    results = []
    try:
        for overrides in runs:
            mine = measure_config(overrides, args.steps, args.vocab_size, not args.no_trainer_view, args.allocator, not args.no_dispatch)
            gc.freeze()  # what outlived the config's engine (modules it imported, their caches) outlives the process's configs
            if dist.is_initialized() and dist.get_world_size() > 1:
                gathered: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, mine)
            else:
                gathered = [mine]
            results.append(gathered)
    finally:
        teardown()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    # The group is torn down and the results are written: leave without running C++ static
    # destructors, where gloo's worker threads sometimes abort ("terminate called without
    # an active exception") after several FSDP2 engines were built in one process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    runs: list[list[str]],
    world_size: int,
    steps: int = 3,
    vocab_size: int | None = None,
    timeout: float = 600.0,
    trainer_view: bool = True,
    allocator: bool = False,
    threads: int = 1,
    dispatch: bool = True,
) -> list[list[dict[str, Any]]]:
    """Measure each override list with ``world_size`` real processes; per run, one result per rank
    (``allocator``: with the CPU allocator's peak beside MemTracker's, see :func:`measure_config`)."""
    with tempfile.TemporaryDirectory() as tmp:
        runs_path, out_path = os.path.join(tmp, "runs.json"), os.path.join(tmp, "out.json")
        with open(runs_path, "w") as f:
            json.dump(runs, f)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(world_size),
            "--master_port",
            str(free_port()),
            "-m",
            "harness.planner.measure",
            "--runs",
            runs_path,
            "--out",
            out_path,
            "--steps",
            str(steps),
        ]
        if vocab_size:
            cmd += ["--vocab-size", str(vocab_size)]
        if not trainer_view:
            cmd += ["--no-trainer-view"]
        if allocator:
            cmd += ["--allocator"]
        if not dispatch:
            cmd += ["--no-dispatch"]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=_repo_root() + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"measurement failed (rc={proc.returncode}):\n{tail}")
        with open(out_path) as f:
            return json.load(f)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
    imports_done()
    sys.exit(_main())
