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

After the measured steps one more step is measured by the trainer's own
``StepMemoryTracker`` (``harness.memory.tracking``), so the two measurements can be set
side by side; the trainer's tracker counts a buffer allocated before the step only once
the step touches it.

Run on each rank by ``torchrun`` (see :func:`launch`); results come back as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from harness.config import load_config, load_strategy
from harness.distributed import init_distributed, teardown
from harness.engine import build_engine, hidden_size_of, plan_engine
from harness.memory import CATEGORIES as CATS
from harness.memory import FrozenAwareMemTracker, StepMemoryTracker, category_of
from harness.models import model_spec
from harness.training import causal_lm_loss


def _cpu_categories(snap: dict[Any, dict[Any, int]]) -> dict[str, int]:
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


def measure_config(overrides: list[str], steps: int = 3, vocab_size: int | None = None, trainer_view: bool = True) -> dict[str, Any]:
    """Build the run's engine on this rank and measure ``steps`` steps; the process group must be up."""
    cfg = load_config(None, overrides)
    strategy = load_strategy(cfg.strategy)
    info = init_distributed("cpu", force_group=strategy.needs_process_group)
    gen = torch.Generator().manual_seed(1000 + info.rank)
    tracker = FrozenAwareMemTracker()  # torch's MemTracker, which refuses a frozen parameter (a LoRA base)
    with tracker:
        spec = model_spec(cfg.model.name, vocab_size=vocab_size, seed=cfg.model.seed)
        vocab = int(spec.config.vocab_size)
        plan = plan_engine(cfg, strategy, info.world_size, info.device, hidden_size_of(spec.config))
        loss_fn = lambda m, ids: causal_lm_loss(m, ids, chunk_size=cfg.memory.loss_chunk_size)
        engine = build_engine(spec, cfg, plan, info, loss_fn)
        batches = [torch.randint(0, vocab, (cfg.micro_batch_size, cfg.data.seq_len), generator=gen) for _ in range(cfg.grad_accum)]
    per_step: list[dict[str, int]] = []
    for _ in range(steps):
        tracker.reset_mod_stats()
        with tracker:
            for micro, batch in enumerate(batches):
                if micro:
                    tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise
                loss = engine.forward_loss(batch)
                engine.backward(loss, last_micro=micro == len(batches) - 1)
                del loss
            engine.step()
        per_step.append(_cpu_categories(tracker.get_tracker_snapshot("peak")))
    trainer_peak, trainer_error = _trainer_view_step(engine, batches) if trainer_view else (None, None)
    best = max(per_step, key=lambda s: s["total"])
    result = {
        "overrides": overrides,
        "rank": info.rank,
        "world_size": info.world_size,
        "peak": best["total"],
        "peak_by_category": best,
        "per_step": [s["total"] for s in per_step],
        "trainer_tracker_peak": trainer_peak,
        "trainer_tracker_error": trainer_error,
    }
    del engine, tracker
    gc.collect()
    return result


def _trainer_view_step(engine: Any, batches: list[torch.Tensor]) -> tuple[int | None, str | None]:
    """One more step, measured by the trainer's own ``StepMemoryTracker``: (peak total, error)."""

    view = StepMemoryTracker(engine.model, engine.optimizer, enabled=True, storage=engine.memory_storage())
    try:
        with view.step():
            for micro, batch in enumerate(batches):
                loss = engine.forward_loss(batch)
                engine.backward(loss, last_micro=micro == len(batches) - 1)
                del loss
            engine.step()
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
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    with open(args.runs) as f:
        runs = json.load(f)

    results = []
    try:
        for overrides in runs:
            mine = measure_config(overrides, args.steps, args.vocab_size, not args.no_trainer_view)
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
    runs: list[list[str]], world_size: int, steps: int = 3, vocab_size: int | None = None, timeout: float = 600.0, trainer_view: bool = True
) -> list[list[dict[str, Any]]]:
    """Measure each override list with ``world_size`` real processes; per run, one result per rank."""
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
            str(_free_port()),
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
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_repo_root() + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"measurement failed (rc={proc.returncode}):\n{tail}")
        with open(out_path) as f:
            return json.load(f)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(_main())
