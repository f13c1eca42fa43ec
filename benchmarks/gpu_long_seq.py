"""The long-sequence rung: the longest ``data.seq_len`` the planner says fits on this GPU, beside the
longest that runs. ``harness.plan --max-seq-len`` answers on the host; the GPU then runs 2 steps at
that length and at one step more, and the item says which ran, which ran out of memory, and each
run's ``max_memory_allocated`` beside the planner's bytes for that length.

The model is the table's saved ~323M Llama with its positions raised (a folder whose config.json
says so and whose weights are links to the saved ones): the run's pre-flight refuses a
``data.seq_len`` beyond ``max_position_embeddings``, and RoPE has no learned table to outgrow.
Nothing of the harness is imported here (its command lines only).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu_models import model_for
from gpu_parts import ESTIMATE_S, run_train
from gpu_runs import REPO, tail, write_config

POSITIONS = 1 << 20  # the copy's max_position_embeddings: never the limit the rung measures
KEYS = ("long_seq/at_plan", "long_seq/past_plan")  # the planner's length, and one step past it
# GPU: no activation checkpointing. With full AC the ~323M model fits ~1M tokens on an H200, where
# attention's s^2 compute makes one step take many minutes; without it the planner answers 135,168 tokens on an H200.
# GPU_SUITE_LONG_AC=full asks for the other rung.
GPU_LONG = {"ac": os.environ.get("GPU_SUITE_LONG_AC", "none"), "step": 4096, "chunk": 4096, "plan_timeout_s": 120}
DRY_LONG = {"ac": "full", "step": 512, "chunk": 1024, "plan_timeout_s": 240, "gpu_mem": "32MiB"}


def long_model(saved: str) -> Path:
    """The saved model with ``POSITIONS`` positions: a sibling folder of links, its own config.json."""
    src = Path(saved)
    dst = src.parent / f"{src.name}-long"
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = POSITIONS
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def long_config(ctx: Any, model: str, seq: int) -> dict[str, Any]:
    knobs = DRY_LONG if ctx.dry and not ctx.sim else GPU_LONG
    cfg: dict[str, Any] = {
        "model": {"name": model},
        "data": dict(ctx.cfg["table_data"], seq_len=seq, max_tokens=max(ctx.cfg["table_data"]["max_tokens"], 4 * seq)),
        "strategy": "ddp",
        "precision": "bf16",
        "micro_batch_size": 1,
        "grad_accum": 1,
        "steps": 2,
        "eval_batches": 1,
        "optim": {"lr": 1.0e-3, "warmup_steps": 1},
        "logging": {"wandb": False, "progress": False, "plots": False},
        "memory": {"track": True, "track_every": 1000, "activation_checkpointing": knobs["ac"], "loss_chunk_size": knobs["chunk"]},
    }
    if ctx.dry and not ctx.sim:
        cfg["device"] = "cpu"
    return cfg


def ask_planner(ctx: Any, config: Path, step: int, gpu_mem: str, timeout: float) -> dict[str, Any]:
    """``harness.plan --max-seq-len`` on the host (GPU hidden): its JSON, or why there is none."""
    out = config.parent / "max_seq_len.json"
    cmd = [ctx.py, "-m", "harness.plan", "--config", str(config), "--gpus", "1", "--gpu-mem", gpu_mem]
    cmd += ["--max-seq-len", "--seq-step", str(step), "--json", str(out)] + (["--target", "cpu"] if ctx.dry else [])
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=ctx.env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = None, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    (config.parent / "max_seq_len.txt").write_text(f"$ {' '.join(cmd)}\n{text}")
    res: dict[str, Any] = {"rc": rc, "seconds": round(time.time() - t0, 1), "command": " ".join(cmd), "gpu_mem": gpu_mem}
    if rc in (0, 10) and out.exists():
        return dict(res, **json.loads(out.read_text()))
    return dict(res, reason=f"harness.plan --max-seq-len exit {rc}", log_tail=tail(text, 1500))


def outcome(run: dict[str, Any] | None) -> str:
    """'ran', 'out of memory', 'not run' or the run's other status."""
    if not run:
        return "not run"
    if run.get("status") in ("ok", "simulated"):
        return "ran"
    if "out of memory" in (run.get("log_tail") or "").lower():
        return "out of memory"
    return str(run.get("status"))


def summarize(plan: dict[str, Any], runs: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    """The rung's item from the planner's answer and the runs at each length (None: not run)."""
    device = {p["seq_len"]: p["device_bytes"] for p in plan.get("probes") or []}
    rows, longest_ran, first_failed = [], None, None
    for seq in sorted(runs):
        run, said = runs[seq], outcome(runs[seq])
        allocated = ((run or {}).get("metrics") or {}).get("max_allocated_bytes")
        need = device.get(seq)
        row = {"seq_len": seq, "outcome": said, "max_memory_allocated": allocated, "planner_device_bytes": need}
        row["planner_fits"] = seq <= plan["max_seq_len"]
        row["allocated_over_planner"] = round(allocated / need, 3) if allocated and need else None
        rows.append(row)
        if said == "ran":
            longest_ran = seq
        elif said == "out of memory" and first_failed is None:
            first_failed = seq
    return {
        "planner_max_seq_len": plan["max_seq_len"],
        "step": plan["step"],
        "longest_that_ran": longest_ran,
        "first_that_did_not": first_failed,
        "rows": rows,
        "planner_probes": len(plan.get("probes") or []),
        "note": "planner_device_bytes: the probe's device need (peak + GPU allowance); the plain peak per run is in plan/long_seq/*",
    }


def part_long_seq(ctx: Any) -> None:
    if ctx.state.settled("long_seq"):
        return
    saved = model_for(ctx, "table")
    if saved is None:
        ctx.state.item("long_seq", {"status": "skipped", "reason": "no saved model (see item saved_model)"})
        return
    knobs = DRY_LONG if ctx.dry and not ctx.sim else GPU_LONG
    if ctx.remaining() - 10 < ESTIMATE_S["long_seq_plan"] + 2 * ctx.cfg["min_start_s"]:
        ctx.not_reached("long_seq")
        return
    model = str(Path(saved).parent / f"{Path(saved).name}-long") if ctx.sim else str(long_model(saved))
    work = ctx.runs / "long_seq"
    work.mkdir(exist_ok=True)
    config = work / "config.json"
    write_config(config, long_config(ctx, model, ctx.cfg["table_data"]["seq_len"]))
    gpu_mem = knobs.get("gpu_mem") or (f"{ctx.gpu_mem_mib}MiB" if ctx.gpu_mem_mib else "80GiB")
    if ctx.sim:
        ctx.clock.spend(ESTIMATE_S["long_seq_plan"])
        plan = {"max_seq_len": knobs["step"], "step": knobs["step"], "probes": [], "simulated": True}
    else:
        plan = ask_planner(ctx, config, knobs["step"], gpu_mem, min(knobs["plan_timeout_s"], ctx.remaining() - 30))
    if not plan.get("max_seq_len"):
        ctx.state.item("long_seq", dict(plan, status="failed", reason=plan.get("reason") or "the planner says no length fits"))
        return
    runs: dict[int, dict[str, Any] | None] = {}
    for key, seq in zip(KEYS, (plan["max_seq_len"], plan["max_seq_len"] + plan["step"]), strict=True):
        cfg = long_config(ctx, model, seq)
        runs[seq] = run_train(ctx, key, cfg, 150, 0, ESTIMATE_S["long_seq_run"], {"seq_len": seq}) or ctx.state.get(key)
    asked = {k: plan.get(k) for k in ("seconds", "command", "rc")}
    item = dict(summarize(plan, runs), status="simulated" if ctx.sim else "ok", gpu_mem=gpu_mem, model=model, planner=asked)
    ctx.state.item("long_seq", item)


def report_lines(item: dict[str, Any] | None) -> list[str]:
    """gpu.md's section: the planner's answer, then each length's outcome beside the planner's bytes."""
    if not item or "rows" not in item:
        return [f"Not measured: {(item or {}).get('status', 'not run')} {(item or {}).get('reason') or ''}".rstrip()]
    lines = [
        f"Planner (`harness.plan --max-seq-len`, step {item['step']:,}, {item.get('gpu_mem')}): "
        f"**{item['planner_max_seq_len']:,}** tokens; longest that ran: {item['longest_that_ran'] or 'none'}; "
        f"first out of memory: {item['first_that_did_not'] or 'none'}.",
        "",
        "| seq_len | planner says | outcome | max_memory_allocated | planner device need | ratio |",
        "|---:|---|---|---:|---:|---:|",
    ]

    def mib(b: int | None) -> str:
        return "-" if b is None else f"{b / 2**20:,.1f} MiB"

    for r in item["rows"]:
        lines.append(
            f"| {r['seq_len']:,} | {'fits' if r['planner_fits'] else 'over'} | {r['outcome']} | "
            f"{mib(r['max_memory_allocated'])} | {mib(r['planner_device_bytes'])} | "
            f"{r['allocated_over_planner'] or '-'} |"
        )
    return lines
