"""The memory ladder on a real model: each rung's measured per-rank peak beside the planner's.

    R=benchmarks/results/ladder
    OMP_NUM_THREADS=2 nice -n 19 python benchmarks/ladder_chart.py --out $R/ladder_chart.json
    python benchmarks/ladder_chart.py --from-json $R/ladder_chart.json --png $R/ladder_chart.png   # table + chart only

SmolLM2-135M-Instruct (`benchmarks/real_model.py`, fp32 safetensors) at seq 512, micro-batch 1.
For every rung `python -m harness.plan --recommend` lists at a world size
(`harness.planner.ladder.rung_overrides`: each rung's overrides added to those above it), one
real run of that config is measured by `harness.planner.measure` (the trainer's own engine and
loss, real CPU tensors, one fresh process group per rung) with the CPU allocator's account on
(`harness.memory.tracking.allocator.AllocatorTrace`): the running sum of every allocation and
free from before the model is built, which sees what MemTracker cannot (bitsandbytes' CPU kernel,
torchao's quantized-state subclasses, torchao's compiled step). MemTracker's peak is kept beside it
where it could run. The planner's column is `harness.planner.estimate` of the same config for a CPU
target, recomputed at report time (``--from-json``), so a planner change needs no new measurement.

What a CPU run is not: there is no paging (bitsandbytes' paged states are plain tensors on CPU),
no CUDA context or allocator rounding, and the host is the device (offload rungs move bytes from
"device" to "host" of the same memory: their per-rank peak counts both). A rung that cannot run
here is listed with the reason the run gave, not dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, no display
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import real_model  # noqa: E402

from harness.config import load_config  # noqa: E402
from harness.planner import estimate  # noqa: E402
from harness.planner.ladder import RUNGS, rung_overrides  # noqa: E402
from harness.planner.measure import launch  # noqa: E402

GIB = 1 << 30


def shape_overrides(model_dir: str, seq_len: int, micro_batch: int) -> list[str]:
    return [f"model.name={model_dir}", f"data.seq_len={seq_len}", f"micro_batch_size={micro_batch}"]


def measure_rungs(
    shape: list[str], world: int, steps: int, out: str | None, done: list[dict], timeout: float, only: list[str]
) -> list[dict]:
    """One launch per rung (a refused or failing rung does not stop the others); the JSON is rewritten
    after each, so an interrupted sweep keeps what it measured."""
    rows = list(done)
    have = {(r["world"], r["rung"]) for r in rows}
    for rung, applied in rung_overrides(world, load_config(None, shape).optim.grad_clip):
        if (world, rung.name) in have or (only and not any(o in rung.name for o in only)):
            continue
        overrides = [*shape, *applied]
        row: dict = {"world": world, "rung": rung.name, "overrides": overrides, "applied": applied}
        start = time.perf_counter()
        try:
            # MemTracker off (dispatch=False): it about doubles a step here, and the allocator sees more
            ranks = launch(
                [overrides], world, steps, timeout=timeout, trainer_view=False, allocator=True, threads=max(1, 2 // world), dispatch=False
            )[0]
            row["allocator"] = max(r["allocator_peak"] for r in ranks)
            memtracker = [r["peak"] for r in ranks if r["method"] == "memtracker"]
            row["memtracker"] = max(memtracker) if memtracker else None
            row["method"] = ranks[0]["method"]
            row["per_step"] = [r["allocator_per_step"] for r in ranks]
        except (RuntimeError, TimeoutError, OSError) as exc:
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            reason = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else repr(exc))
            row["error"] = reason.strip()[-400:]
        except Exception as exc:  # subprocess.TimeoutExpired and the like: recorded, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(f"... world {world} {rung.name}: {row.get('allocator', row.get('error'))} ({row['seconds']} s)", file=sys.stderr, flush=True)
        if out:
            Path(out).write_text(json.dumps(rows, indent=1))
    return rows


def planned(row: dict) -> tuple[int | None, int, str, str]:
    """(planned per-rank bytes, the gloo buffer a run may or may not hold at its peak, the planner's
    peak moment, or the planner's refusal)."""
    try:
        est = estimate(load_config(None, row["overrides"]), row["world"], target="cpu")
    except Exception as exc:  # a config the planner refuses is a row of the table too
        return None, 0, "", f"{type(exc).__name__}: {exc}"
    return est.total, est.race_bytes, est.peak.name, ""


def error(plan: int, race: int, measured: int) -> float:
    """Planned against measured; a run peaks in [plan - race, plan] (`collective_race_bytes`), as
    benchmarks/plan_accuracy.py judges it."""
    return (min(max(measured, plan - race), plan) - measured) / measured


def own_overrides(row: dict) -> str:
    """What this rung itself adds (its entry in `RUNGS`), ``{shard}``/``{grad_clip}`` filled in."""
    values = {"shard": "fsdp" if row["world"] > 1 else "ddp", "grad_clip": "1"}
    rung = next((r for r in RUNGS if r.name == row["rung"]), None)
    return " ".join(o.format(**values) for o in rung.overrides) if rung and rung.overrides else "(the defaults: fp32, ddp, AdamW)"


def report(rows: list[dict], png: str | None, title: str) -> str:
    lines = [
        "| world | rung | the rung adds | planned GiB | of it gloo's buffer | measured GiB (allocator) | MemTracker GiB | error "
        "| planned peak moment |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    bars = []
    for row in rows:
        plan, race, moment, plan_err = planned(row)
        gloo = f"{race / GIB:.3f}" if race else "-"
        measured = row.get("allocator")
        config = own_overrides(row)
        label = f"w{row['world']} {row['rung']}"
        if measured is None:
            why = row.get("error", "not measured")
            lines.append(
                f"| {row['world']} | {row['rung']} | {config} | {'-' if plan is None else f'{plan / GIB:.3f}'} | {gloo} | "
                f"not run: {why} | - | - | {moment or plan_err} |"
            )
            bars.append((label, plan, None, race))
            continue
        mt = row.get("memtracker")
        err = "-" if plan is None else f"{error(plan, race, measured):+.1%}"
        plan_gib = "-" if plan is None else f"{plan / GIB:.3f}"
        lines.append(
            f"| {row['world']} | {row['rung']} | {config} | {plan_gib} | {gloo} | {measured / GIB:.3f} | "
            f"{'-' if mt is None else f'{mt / GIB:.3f}'} | {err} | {moment or plan_err} |"
        )
        bars.append((label, plan, measured, race))
    if png and bars:
        fig, ax = plt.subplots(figsize=(11, 0.45 * len(bars) + 1.6))
        ys = list(range(len(bars)))
        ax.barh([y - 0.2 for y in ys], [(p or 0) / GIB for _, p, _, _ in bars], height=0.4, label="planned (harness.plan, target cpu)")
        ax.barh([y + 0.2 for y in ys], [(m or 0) / GIB for _, _, m, _ in bars], height=0.4, label="measured (CPU allocator, per rank)")
        for y, (_, p, m, r) in zip(ys, bars):
            if m is None:
                ax.text(0.02, y + 0.2, "not run on this CPU (see table)", va="center", fontsize=7)
            elif p:
                ax.text(max(p, m) / GIB + 0.02, y, f"{error(p, r, m):+.1%}", va="center", fontsize=7)
        ax.set_yticks(ys, [name[:60] for name, _, _, _ in bars], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("per-rank peak, GiB")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: benchmarks/real_model.py's SmolLM2-135M, prepared once)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per rung (the first makes the optimizer state)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1])
    parser.add_argument("--rungs", nargs="*", default=[], help="only the rungs whose name contains one of these")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per rung's run")
    parser.add_argument("--out", help="measured peaks JSON (resumed: rungs already in it are not measured again)")
    parser.add_argument("--from-json", help="measured peaks from an earlier run: only the planner runs")
    parser.add_argument("--png", help="write the bar chart here")
    args = parser.parse_args()
    model_dir = args.model or str(real_model.prepare())
    shape = shape_overrides(model_dir, args.seq_len, args.micro_batch)
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
    else:
        rows = json.loads(Path(args.out).read_text()) if args.out and os.path.exists(args.out) else []
        for world in args.worlds:
            rows = measure_rungs(shape, world, args.steps, args.out, rows, args.timeout, args.rungs)
    title = (
        f"Memory ladder, {Path(model_dir).name} seq {args.seq_len} micro-batch {args.micro_batch}: "
        "planned vs measured per-rank peak (2-core CPU)"
    )
    print(report(rows, args.png, title))


if __name__ == "__main__":
    main()
