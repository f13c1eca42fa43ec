"""Where harness's FSDP2 step spends CPU that a hand-written FSDP2 loop does not: CPU time, not wall time.

    OMP_NUM_THREADS=1 python benchmarks/step_cpu_profile.py [--model tiny-llama] [--rounds 4] [--block 10]
                                                            [--top 25] [--set key=value ...]

The same two sides as `benchmarks/fsdp_loop_ratio.py` (its `HandLoop` and run config: world 2
under torchrun, gloo, CPU; one process per rank builds harness's trainer and the torchtitan-style
loop over the same model preset and batches). On a shared machine wall time says how busy the
neighbours are; CPU time says what a side *did*. Per rank and side, alternating blocks of
`--block` steps `--rounds` times:

- CPU ms per step: the main thread's (`time.thread_time`: Python, dispatch, the kernels of a
  1-thread run) and the process's (`time.process_time`: also gloo's threads and any waiting
  they burn);
- aten ops per step and their self CPU time (`torch.profiler`, one block per side), the ops
  whose count or time differs most between the two sides;
- Python functions by own time (`cProfile`, one block per side): the top `--top` of harness's
  side, with the loop's time in the same function next to it.

Rank 0 prints the tables (markdown); both ranks' CPU times are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_loop_ratio import HandLoop, run_sides


def cpu_block(fn: Callable[[], None], steps: int) -> tuple[float, float]:
    """Main-thread and process CPU ms per step of `fn` (which runs `steps` steps)."""
    dist.barrier()
    thread0, proc0 = time.thread_time(), time.process_time()
    fn()
    thread, proc = time.thread_time() - thread0, time.process_time() - proc0
    dist.barrier()
    return thread / steps * 1e3, proc / steps * 1e3


def op_table(fn: Callable[[], None], steps: int) -> dict[str, tuple[float, float]]:
    """aten op -> (calls per step, self CPU ms per step) over one block."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    dist.barrier()
    return {e.key: (e.count / steps, e.self_cpu_time_total / 1e3 / steps) for e in prof.key_averages()}


def py_table(fn: Callable[[], None], steps: int, dump: Path | None) -> dict[str, tuple[float, float, float]]:
    """function -> (calls per step, own ms per step, cumulative ms per step) over one block;
    the raw profile written to `dump` (for `pstats`: callers, callees)."""
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    dist.barrier()
    if dump is not None:
        prof.dump_stats(dump)
    stats = pstats.Stats(prof, stream=io.StringIO())
    out = {}
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = file.split("site-packages/")[-1].split("/step-overhead/")[-1]
        out[f"{where}:{line}({name})"] = (calls / steps, own / steps * 1e3, cum / steps * 1e3)
    return out


def worker(model: str, rounds: int, block: int, out_dir: Path, overrides: list[str]) -> None:
    def measure(trainer, hand: HandLoop, info) -> dict:
        def sides(first: int) -> dict[str, Callable[[], None]]:
            return {
                "harness": lambda: trainer.train(first, first + block),
                "loop": lambda: [hand.step(s) for s in range(first, first + block)],
            }

        cpu: dict[str, list[tuple[float, float]]] = {"harness": [], "loop": []}
        for r in range(1, rounds + 1):
            for side, fn in sides(r * block).items():
                cpu[side].append(cpu_block(fn, block))
        first = (rounds + 1) * block
        ops = {side: op_table(fn, block) for side, fn in sides(first).items()}
        py = {side: py_table(fn, block, out_dir / f"rank{info.rank}_{side}.pstats") for side, fn in sides(first + block).items()}
        return {"rank": info.rank, "cpu": cpu, "ops": ops, "py": py}

    result = run_sides(model, (rounds + 3) * block, block, overrides, measure)
    (out_dir / f"rank{int(os.environ.get('RANK', '0'))}.json").write_text(json.dumps(result))


def report(results: list[dict], top: int) -> None:
    print("| rank | side | main-thread CPU ms/step: median (min, max) | process CPU ms/step: median (min, max) |")
    print("|---|---|---|---|")
    for r in results:
        for side in ("harness", "loop"):
            thread = [t for t, _ in r["cpu"][side]]
            proc = [p for _, p in r["cpu"][side]]
            print(
                f"| {r['rank']} | {side} | {statistics.median(thread):.1f} ({min(thread):.1f}, {max(thread):.1f}) "
                f"| {statistics.median(proc):.1f} ({min(proc):.1f}, {max(proc):.1f}) |"
            )
    print("\nloop / harness, per round (each round's two blocks ran back to back), median over rounds:")
    for r in results:
        paired = {
            kind: statistics.median(lp[i] / h[i] for h, lp in zip(r["cpu"]["harness"], r["cpu"]["loop"]))
            for i, kind in enumerate(("main-thread", "process"))
        }
        print(f"rank {r['rank']}: main-thread CPU {paired['main-thread']:.3f}, process CPU {paired['process']:.3f}")
    r0 = results[0]
    h, lp = r0["ops"]["harness"], r0["ops"]["loop"]
    total = {side: (sum(c for c, _ in t.values()), sum(ms for _, ms in t.values())) for side, t in r0["ops"].items()}
    print(
        f"\nrank 0, ops per step (calls, self CPU ms): harness {total['harness'][0]:.0f}, {total['harness'][1]:.1f}; "
        f"loop {total['loop'][0]:.0f}, {total['loop'][1]:.1f}"
    )
    print("\n| op (rank 0) | harness calls/step | loop calls/step | harness self ms/step | loop self ms/step | difference ms |")
    print("|---|---|---|---|---|---|")
    keys = sorted(set(h) | set(lp), key=lambda k: -abs(h.get(k, (0, 0))[1] - lp.get(k, (0, 0))[1]))
    for k in keys[:top]:
        hc, hm = h.get(k, (0.0, 0.0))
        lc, lm = lp.get(k, (0.0, 0.0))
        print(f"| `{k}` | {hc:.1f} | {lc:.1f} | {hm:.2f} | {lm:.2f} | {hm - lm:+.2f} |")
    ph, pl = r0["py"]["harness"], r0["py"]["loop"]
    print("\n| Python function (rank 0, cProfile) | calls/step | own ms/step | cumulative ms/step | loop own ms/step |")
    print("|---|---|---|---|---|")
    for k in sorted(ph, key=lambda k: -ph[k][1])[:top]:
        calls, own, cum = ph[k]
        print(f"| `{k}` | {calls:.1f} | {own:.2f} | {cum:.2f} | {pl.get(k, (0, 0, 0))[1]:.2f} |")
    only = sorted((k for k in ph if k not in pl), key=lambda k: -ph[k][2])
    print("\n| harness-only Python function (rank 0) | calls/step | cumulative ms/step |")
    print("|---|---|---|")
    for k in only[:top]:
        print(f"| `{k}` | {ph[k][0]:.1f} | {ph[k][2]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--set", nargs="*", default=[], help="harness config overrides, key=value (a diagnosis)")
    parser.add_argument("--out", default=None, help="keep each rank's results and cProfile dumps (pstats) in this folder")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.block, Path(args.out), args.set)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29573"]
        cmd += [__file__, "--worker", args.model, "--rounds", str(args.rounds), "--block", str(args.block)]
        cmd += ["--out", str(out), "--set", *args.set]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the workers failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"{args.model}, blocks of {args.block} steps x {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}\n")
    report(results, args.top)


if __name__ == "__main__":
    main()
