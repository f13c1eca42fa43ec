"""Predicted vs measured step peak for every optimizer rung (optim.name x precision x engine).

    TORCHDYNAMO_DISABLE=1 nice -n 19 python benchmarks/optimizer_accuracy.py --out notes/optimizer_accuracy.json
    python benchmarks/optimizer_accuracy.py --from-json notes/optimizer_accuracy.json   # the table again, planner re-run

Each config is a real run measured the way ``benchmarks/plan_accuracy.py`` measures
(``harness.planner.measure``: MemTracker over every storage the process allocates, 3 steps, the
worst rank's largest step), beside ``harness.planner.estimate`` of the same config for a CPU
target. The measured peaks are kept in a JSON file so the planner's column can be recomputed
after a planner change without measuring again (the measurement does not depend on the planner).
torchao's step runs eager (``TORCHDYNAMO_DISABLE=1``), as in the tests; a compiled step on a GPU
may fuse temporaries away. bitsandbytes on CPU is its plain 8-bit step (no paging).

MemTracker follows the storages of the ops it sees through torch's dispatch; a custom op's kernel
(bitsandbytes' ``optimizer_update_8bit_blockwise``, registered for CPU in Python) runs below it, so
the fp32 copies that kernel makes are invisible to it. World-1 cases are therefore measured a second
way too (``--profile``): the whole run in-process under ``torch.profiler`` with ``profile_memory``,
the running sum of every allocation and free the CPU allocator reports (inside custom ops too),
its largest value during the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from time import time_ns

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from harness.config import load_config, load_strategy
from harness.distributed import free_port, init_distributed, teardown
from harness.engine import build_engine, hidden_size_of, plan_engine
from harness.models import model_spec
from harness.planner import estimate
from harness.planner.measure import launch
from harness.training import causal_lm_loss

OIB = ["memory.optimizer_in_backward=true", "optim.grad_clip=0"]
# (world, strategy, optimizer, precision, extra overrides): every combination the trainer accepts
CASES: list[tuple[int, str, str, str, list[str]]] = [
    *[(1, "ddp", name, "fp32", []) for name in ("adamw", "adamw_bf16", "adamw_8bit", "adamw_4bit", "paged_adamw_8bit")],
    (1, "ddp", "adamw", "bf16", []),
    (1, "ddp", "paged_adamw_8bit", "bf16", []),
    *[(1, "ddp", name, "bf16_pure", []) for name in ("adamw_bf16", "adamw_8bit", "adamw_4bit")],
    (1, "ddp", "adamw_8bit", "bf16_pure", OIB),
    (1, "ddp", "paged_adamw_8bit", "bf16", OIB),
    *[(2, "fsdp", name, "fp32", []) for name in ("adamw", "adamw_bf16", "adamw_8bit", "adamw_4bit")],
    (2, "fsdp", "adamw_bf16", "bf16_pure", []),
    (2, "fsdp", "adamw_8bit", "fp32", OIB),
]


def overrides_of(case: tuple[int, str, str, str, list[str]], shape: list[str]) -> list[str]:
    _, strategy, name, precision, extra = case
    return [f"strategy={strategy}", *shape, f"optim.name={name}", f"precision={precision}", *extra]


def profiled_peak(overrides: list[str], vocab_size: int, steps: int = 2) -> int:
    """This rank: the largest running sum of the CPU allocator's allocations during the steps (the
    first step makes the optimizer state, the second is a step like every later one)."""
    cfg = load_config(None, overrides)
    strategy = load_strategy(cfg.strategy)
    info = init_distributed("cpu", force_group=strategy.needs_process_group)
    gen = torch.Generator().manual_seed(1000 + info.rank)
    marks: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        spec = model_spec(cfg.model.name, vocab_size=vocab_size, seed=cfg.model.seed)
        plan = plan_engine(cfg, strategy, info.world_size, info.device, hidden_size_of(spec.config))
        engine = build_engine(spec, cfg, plan, info, lambda m, ids: causal_lm_loss(m, ids, chunk_size=cfg.memory.loss_chunk_size))
        batches = [torch.randint(0, int(spec.config.vocab_size), (cfg.micro_batch_size, cfg.data.seq_len), generator=gen)]
        marks.append(time_ns())
        for _ in range(steps):
            for micro, batch in enumerate(batches):
                loss = engine.forward_loss(batch)
                engine.backward(loss, last_micro=micro == len(batches) - 1)
                del loss
            engine.step()
        marks.append(time_ns())
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    running, peak = 0, 0
    for e in events:
        running += e.nbytes()
        if marks[0] <= e.start_ns() <= marks[1]:
            peak = max(peak, running)
    return peak


def profile_worker(runs_path: str, out_path: str, vocab_size: int) -> None:
    """One rank of a profiled launch: each run's profiled peak, the worst rank's written by rank 0."""
    with open(runs_path) as f:
        runs = json.load(f)
    peaks = [profiled_peak(overrides, vocab_size) for overrides in runs]
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, peaks)
        peaks = [max(ranks) for ranks in zip(*gathered)]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(peaks, f)
    teardown()


def launch_profiled(runs: list[list[str]], world: int, vocab_size: int) -> list[int]:
    """``world`` processes (torchrun) running :func:`profile_worker` over ``runs``."""
    with tempfile.TemporaryDirectory() as tmp:
        runs_path, out_path = os.path.join(tmp, "runs.json"), os.path.join(tmp, "out.json")
        with open(runs_path, "w") as f:
            json.dump(runs, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(free_port())]
        cmd += [os.path.abspath(__file__), "--vocab-size", str(vocab_size), "--worker", runs_path, out_path]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        with open(out_path) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", help="write the measured peaks here (JSON)")
    parser.add_argument("--from-json", help="measured peaks from an earlier run: only the planner runs")
    parser.add_argument("--profile", action="store_true", help="add the profiler's peak to every case of --from-json")
    parser.add_argument("--worker", nargs=2, metavar=("RUNS", "OUT"), help=argparse.SUPPRESS)  # one rank of a profiled launch
    args = parser.parse_args()
    shape = [f"model.name={args.model}", f"micro_batch_size={args.micro_batch}", f"data.seq_len={args.seq_len}"]
    runs = [overrides_of(c, shape) for c in CASES]
    if args.worker:
        profile_worker(*args.worker, args.vocab_size)
        return
    if args.from_json:
        with open(args.from_json) as f:
            measured = json.load(f)
        if args.profile:
            for world in sorted({row["world"] for row in measured}):
                rows = [row for row in measured if row["world"] == world and "profiled" not in row]
                for row, peak in zip(rows, launch_profiled([row["overrides"] for row in rows], world, args.vocab_size)):
                    row["profiled"] = peak
                print(f"... world {world} profiled", file=sys.stderr, flush=True)
            with open(args.from_json, "w") as f:
                json.dump(measured, f, indent=1)
    else:
        measured = []
        for world in sorted({c[0] for c in CASES}):
            mine = [(c, r) for c, r in zip(CASES, runs) if c[0] == world]
            results = launch([r for _, r in mine], world, steps=3, vocab_size=args.vocab_size, trainer_view=False, timeout=1800)
            for (case, overrides), ranks in zip(mine, results):
                measured.append({"world": world, "overrides": overrides, "peak": max(r["peak"] for r in ranks)})
            print(f"... world {world} measured", file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(measured, f, indent=1)
    print(
        "| world | strategy | optim.name | precision | opt. in backward | MemTracker peak | profiler peak | planned | "
        "error vs MemTracker | error vs profiler | planned peak moment |"
    )
    print("|---:|---|---|---|---|---:|---:|---:|---:|---:|---|")
    for row in measured:
        cfg = load_config(None, row["overrides"])
        est = estimate(cfg, row["world"], target="cpu", vocab_size=args.vocab_size)
        ours, race = est.total, est.race_bytes

        def err(m: int | None) -> str:  # a run peaks in [total - race, total]
            return "-" if m is None else f"{(min(max(m, ours - race), ours) - m) / m:+.1%}"

        prof = row.get("profiled")
        print(
            f"| {row['world']} | {cfg.strategy} | {cfg.optim.name} | {cfg.precision} | "
            f"{'yes' if cfg.memory.optimizer_in_backward else 'no'} | {row['peak']:,} | {'-' if prof is None else f'{prof:,}'} | "
            f"{ours:,} | {err(row['peak'])} | {err(prof)} | {est.peak.name} |"
        )


if __name__ == "__main__":
    main()
