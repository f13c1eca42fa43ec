"""The GPU suite: one device-tool call is the ordered list of parts below, run against one deadline.
Driven by benchmarks/gpu_suite.sh (setup, this, the log tarball); notes/gpu_plan.md has the calls.

    python benchmarks/gpu_suite.py --state DIR --out OUT --deadline EPOCH [--dry-run] [--sim-clock]
    python benchmarks/gpu_suite.py --make-model DIR --size 300m|llama-1.6b|tiny|tiny-llama
    python benchmarks/gpu_suite.py --state DIR --report GPU_MD RESULTS_JSON

The order is the value order: what matters most runs first, so a call cut anywhere has returned
the most valuable numbers it could. Every finished item is written to OUT at once (results.json
and gpu.md), a part stops after two identical failures, and a second call on the same warm machine
goes on where the first stopped (only items never started run again). GPU_SUITE_ORDER (comma-
separated part names) replaces the order; the knobs of each part are in gpu_parts.py and
gpu_suite.sh's header. --sim-clock: nothing is trained; each run spends its GPU estimate on a
simulated clock, so the CPU rehearsal walks the real order against the real deadline in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_long_seq as long_seq
import gpu_models as models
import gpu_parts as parts
import gpu_report
from gpu_runs import Clock, State, on_term, tail

DEFAULT_ORDER = [
    "preflight",  # imports, CUDA, one tiny step: if it fails, the call ends here in one line
    "facts",
    "strategies_torch",  # ddp, fsdp, fsdp_grad_op, fsdp_offload; plans beside each
    "strategies_deepspeed",  # zero1, zero2, zero3, zero2_offload, zero3_offload (CPU Adam is built meanwhile)
    "throughput_eager",  # llama-1.6b bf16 tokens/s and MFU
    "long_seq",  # the planner's longest seq_len vs the longest that runs (2 steps at it and one step past)
    "matrix_eager",  # the s004 rows without compile
    # PLACE OF THE NEW PRUNING METHOD's GPU part: after the eager rows, before anything compiled.
    "throughput_block",  # compile=block, if time is left
]
# Out of the default (2.5-4 min each): name them in GPU_SUITE_ORDER to run them.
OPTIONAL = ["throughput_model", "matrix_compiled", "matrix_table"]
ALWAYS_FIRST = ("preflight", "facts")  # run in every call that has not run them in this state folder
TAIL_S = 20  # what the shell needs after the parts: the log tarball


class PreflightFailed(Exception):
    pass


def part_preflight(ctx: parts.Ctx) -> None:
    if (ctx.state.get("preflight") or {}).get("status") == "ok":  # passed in an earlier call on this machine
        return
    cmd = [ctx.py, str(Path(__file__).resolve().with_name("gpu_preflight.py"))]
    cmd += ["--cpu"] if ctx.dry else []
    cmd += [a for m in os.environ.get("GPU_SUITE_PREFLIGHT_IMPORT", "").split(",") if m for a in ("--import", m)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=ctx.env())
        lines = proc.stdout.strip().splitlines()
        ok, line = proc.returncode == 0, (lines[-1] if lines else tail(proc.stderr, 300).strip() or f"exit {proc.returncode}")
    except subprocess.TimeoutExpired:
        ok, line = False, "pre-flight: timed out after 90 s"
    ctx.clock.spend(parts.ESTIMATE_S["preflight"])
    if not ok:
        ctx.state.item("preflight", {"status": "failed", "reason": line, "seconds": round(time.time() - t0, 1)})
        raise PreflightFailed(line)
    ctx.state.item("preflight", dict(json.loads(line), status="ok"))
    models.start_prep(ctx)


def part_facts(ctx: parts.Ctx) -> None:
    if ctx.state.settled("facts"):
        return
    facts: dict[str, Any] = {"gpus": ctx.ngpu, "gpu_name": ctx.gpu_name, "gpu_memory_mib": ctx.gpu_mem_mib, "cpu_count": os.cpu_count()}
    pre = ctx.state.get("preflight") or {}
    facts.update({k: v for k, v in pre.items() if k not in ("status", "key", "recorded_at", "call_clock_s", "plan_options")})
    if shutil.which("nvidia-smi") and not ctx.sim:
        for name, args in (
            ("nvidia_smi_L", ["-L"]),
            ("nvidia_smi_query", ["--query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm", "--format=csv"]),
        ):
            try:
                facts[name] = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30).stdout.strip()
            except (OSError, subprocess.TimeoutExpired) as exc:
                facts[name] = f"failed: {exc}"
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        mem = [line for line in meminfo.read_text().splitlines() if line.startswith("MemTotal")]
        facts["host_memory"] = mem[0].split(":", 1)[1].strip() if mem else None
    setup = ctx.state.root / "setup.json"
    if setup.exists():
        facts["setup"] = json.loads(setup.read_text())
    ctx.clock.spend(parts.ESTIMATE_S["facts"])
    ctx.state.data["meta"]["device"] = facts
    ctx.state.item("facts", dict(facts, status="ok"))


def record_cpu_adam_build(ctx: parts.Ctx) -> None:
    """The background DeepSpeed CPU Adam JIT build started by gpu_suite.sh (its rc file appears when it ends)."""
    if ctx.dry or ctx.sim:
        ctx.state.item("setup/cpu_adam_build", {"status": "skipped", "reason": "not on a GPU: DeepSpeedCPUAdam is only used with one"})
        return
    rc_file, log = ctx.state.root / "cpu_adam_build.rc", ctx.state.root / "logs" / "cpu_adam_build.log"
    log_tail = tail(log.read_text(errors="replace"), 1500) if log.exists() else None
    if not rc_file.exists():
        ctx.state.item("setup/cpu_adam_build", {"status": "running" if log.exists() else "not started", "log_tail": log_tail})
        return
    rc = rc_file.read_text().strip()
    ctx.state.item("setup/cpu_adam_build", {"status": "ok" if rc == "0" else "failed", "rc": rc, "log_tail": log_tail})


def part_deepspeed(ctx: parts.Ctx) -> None:
    parts.part_strategies(ctx, parts.DEEPSPEED_STRATEGIES)
    record_cpu_adam_build(ctx)


PARTS = {
    "preflight": part_preflight,
    "facts": part_facts,
    "strategies_torch": lambda ctx: parts.part_strategies(ctx, parts.TORCH_STRATEGIES),
    "strategies_deepspeed": part_deepspeed,
    "long_seq": long_seq.part_long_seq,
    **{f"throughput_{v}": (lambda ctx, v=v: parts.part_throughput(ctx, v)) for v in parts.THROUGHPUT_VARIANTS},
    "matrix_eager": lambda ctx: parts.part_matrix(ctx, compiled=False),
    "matrix_compiled": lambda ctx: parts.part_matrix(ctx, compiled=True),
    "matrix_table": parts.part_matrix_table,
}


def call_order() -> list[str]:
    order = [p.strip() for p in os.environ.get("GPU_SUITE_ORDER", ",".join(DEFAULT_ORDER)).split(",") if p.strip()]
    unknown = [p for p in order if p not in PARTS]
    if unknown:
        raise SystemExit(f"gpu_suite: unknown part(s) in GPU_SUITE_ORDER: {', '.join(unknown)} (known: {', '.join(PARTS)})")
    return order


def left_to_first_call(ctx: parts.Ctx, order: list[str]) -> set[str]:
    """GPU_SUITE_COLD_FROM=PART on the second call: if this state folder is new (the machine went cold
    between the calls, so the first call's state is gone), start at PART rather than redo the first call."""
    start = os.environ.get("GPU_SUITE_COLD_FROM")
    if not (start and ctx.state.fresh and start in order):
        return set()
    return {p for p in order[: order.index(start)] if p not in ALWAYS_FIRST}


def run_call(ctx: parts.Ctx, order: list[str]) -> int:
    """The parts in order until the deadline; 3 when the pre-flight failed (the call ends there)."""
    skip = left_to_first_call(ctx, order)
    for name in order:
        if name in skip:
            ctx.state.part(name, status="skipped", reason="left to the first call: this state folder is new (the machine went cold)")
            continue
        if ctx.remaining() < 15:
            ctx.state.part(name, status="not reached", reason="the call's time was used up")
            continue
        t0 = ctx.clock.now()
        ctx.state.part(name, status="running", started_clock_s=round(t0, 1))
        try:
            PARTS[name](ctx)
        except PreflightFailed as exc:
            ctx.state.part(name, status="failed", reason=str(exc))
            print(f"gpu_suite: {exc}; the call stops here", flush=True)
            return 3
        except Exception as exc:  # one part's bug must not take the later parts with it
            ctx.state.part(name, status="failed", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
            print(traceback.format_exc(), flush=True)
            continue
        ctx.state.part(name, status="done", clock_s=round(ctx.clock.now() - t0, 1))
    parts.finish_plans(ctx)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", default=str(parts.REPO / "runs" / "gpu_suite"))
    parser.add_argument("--out", help="the call's out folder: results.json and gpu.md, rewritten at every item")
    parser.add_argument("--deadline", type=float, help="epoch seconds by which the parts must be done")
    parser.add_argument("--started", type=float, help="epoch seconds the call started (the simulated clock starts there)")
    parser.add_argument("--setup-s", type=float, default=0.0, help="--sim-clock: seconds the setup is estimated to have taken")
    parser.add_argument("--dry-run", action="store_true", help="on this CPU machine: tiny models, no GPU expected")
    parser.add_argument("--sim-clock", action="store_true", help="train nothing; each run spends its GPU estimate on a simulated clock")
    parser.add_argument("--report", nargs=2, metavar=("GPU_MD", "RESULTS_JSON"), help="write the report of --state and stop")
    parser.add_argument("--make-model", metavar="DIR")
    parser.add_argument("--size", default="300m", choices=sorted(models.VOCAB))
    args = parser.parse_args()
    if args.make_model:
        models.make_model(args.make_model, args.size)
        return 0
    if args.report:
        state = State(Path(args.state).resolve(), args.dry_run)
        gpu_report.write(state.data, Path(args.report[0]), Path(args.report[1]))
        return 0
    order = call_order()
    started = args.started or time.time()
    clock = Clock(args.sim_clock, started + (args.setup_s if args.sim_clock else 0.0))
    out = Path(args.out).resolve() if args.out else None
    state = State(Path(args.state).resolve(), args.dry_run, out, lambda data, md: gpu_report.write(data, md, None), clock)
    state.data["meta"].update(simulated_clock=args.sim_clock, order=order)
    ctx = parts.Ctx(state, clock, args.deadline or started + 600, args.dry_run)
    signal.signal(signal.SIGTERM, on_term)
    call = {"started": started, "deadline": ctx.deadline, "simulated_clock": args.sim_clock}
    state.data["meta"].setdefault("calls", []).append(call)
    rc = run_call(ctx, order)
    call.update(used_s=round(clock.now() - started, 1), exit=rc)
    state.save()
    print(f"[gpu_suite] call {'(simulated clock) ' if args.sim_clock else ''}used {clock.now() - started:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
