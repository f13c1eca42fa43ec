"""The GPU suite's measuring parts: the strategy table, llama-1.6b throughput, the s004 matrix rows,
each run's plan beside it, and the GPU estimates the simulated clock spends.

Everything goes through the command lines (``python -m harness.train``, ``python -m harness.plan``,
``python -m harness.experiments``) and the files a run writes; nothing of the harness is imported
here (the model maker in gpu_models.py does, in a process of its own).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpu_models import model_for
from gpu_runs import REPO, Clock, FailureRule, State, cpu_adam_marker, finish_run, gpu_inventory, launch, tail, write_config

MATRIX_YAML = REPO / "experiments" / "peak_memory_gpu.yaml"
TORCH_STRATEGIES = ["ddp", "fsdp", "fsdp_grad_op", "fsdp_offload"]
DEEPSPEED_STRATEGIES = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]  # CPU Adam (offload) last: built meanwhile
NEEDS_GPU = {"fsdp_offload"}  # refused before launch on a CPU-only machine (CPUOffloadPolicy needs an accelerator)
# The s004 rows without compile, in the order their numbers matter (the study's control first).
EAGER_ROWS = ["control fp32", "bf16", "AC", "bf16 + OIB + AC", "OIB + AC", "best (bf16 + OIB + AC + chunked loss)", "optimizer-in-backward"]
THROUGHPUT_VARIANTS = {"eager": {}, "block": {"compile": "block"}, "model": {"compile": "model"}}

# What each run is estimated to take on one H100/H200 (seconds, process start to exit). The simulated
# clock spends these; they are estimates, to be replaced by the first GPU call's wall_s.
ESTIMATE_S = {
    "preflight": 15,
    "facts": 5,
    "long_seq_plan": 40,  # harness.plan --max-seq-len on the host: 5 traced probes of the ~323M model took 35 s on 2 CPU cores
    "long_seq_run": 40,  # each 2-step run at ~135k tokens (H200): ~15 s start and load, ~8 s a step, one eval batch
    "strategy": 35,
    "strategy_offload": 45,
    "throughput_eager": 45,
    "throughput_block": 150,
    "throughput_model": 240,
    "matrix_eager": 45,
    "matrix_fp32": 55,
    "matrix_compiled": 180,
    "matrix_table": 20,
}

# Sizes. GPU: what the plan measures. Dry run: the same code paths on tiny models, 2 steps, CPU.
GPU = {
    "table_model": "300m",
    "table_data": {"seq_len": 1024, "vocab_size": 32000, "max_tokens": 2000000},
    "table_precision": "bf16",
    "table_micro": 8,
    "table_steps": 8,
    "table_eval_batches": 4,
    "table_run_cap_s": 120,
    "tp_model": "llama-1.6b",
    "tp_data": {"seq_len": 2048, "vocab_size": 32000, "max_tokens": 2000000},  # = the matrix's data: one cache
    "tp_micro": int(os.environ.get("GPU_SUITE_THROUGHPUT_MICRO", "8")),
    "tp_steps": 12,
    "tp_warm": 4,
    "tp_run_cap_s": 150,
    # GPU_SUITE_MATRIX_SET (space-separated key=value) replaces this, e.g. adding data.seq_len=1024 if fp32 rows run out of memory
    "matrix_set": os.environ.get("GPU_SUITE_MATRIX_SET", "steps=8 memory.track_every=1000").split(),
    "matrix_eager_cap_s": 120,
    "matrix_compiled_cap_s": 300,
    "min_start_s": 40,
    "min_compiled_s": 120,
    "plan_timeout_s": 240,
    "plan_workers": 3,
    "model_timeout_s": 300,
}
DRY = dict(
    GPU,
    table_model="tiny",
    table_data={"seq_len": 64, "vocab_size": 2048, "max_tokens": 50000},
    table_precision="fp32",
    table_micro=2,
    table_steps=2,
    table_eval_batches=1,
    tp_model="tiny-llama",
    tp_data={"seq_len": 64, "vocab_size": 2048, "max_tokens": 50000},
    tp_micro=2,
    tp_steps=3,
    tp_warm=1,
    matrix_set=[
        "data.seq_len=64",
        "data.vocab_size=2048",
        "data.max_tokens=50000",
        "micro_batch_size=2",
        "steps=2",
        "eval_batches=1",
        "device=cpu",
        "memory.track_every=1000",
    ],
    min_start_s=15,
    min_compiled_s=15,
    plan_workers=1,
)


class Ctx:
    """One call: its sizes, state, clock and deadline, the plans in flight, the models being saved."""

    def __init__(self, state: State, clock: Clock, deadline: float, dry: bool) -> None:
        self.dry, self.sim = dry, clock.simulated
        self.cfg = GPU if (self.sim or not dry) else DRY  # a rehearsal records the GPU's configs
        self.state, self.clock, self.deadline = state, clock, deadline
        self.py = os.environ.get("PY") or sys.executable
        self.runs = state.root / "runs"
        self.runs.mkdir(exist_ok=True)
        self.ngpu, self.gpu_mem_mib, self.gpu_name = (0, None, None) if self.sim else gpu_inventory()
        self.plans: list[Future] = []
        self.pool = ThreadPoolExecutor(max_workers=self.cfg["plan_workers"])
        self.prep = ThreadPoolExecutor(max_workers=1)  # models and data caches, one at a time, beside the GPU runs
        self.models: dict[str, Future] = {}

    def remaining(self) -> float:
        return self.deadline - self.clock.now()

    def budget(self, cap: float, minimum: float | None = None) -> float | None:
        """Seconds to give the next run: min(cap, time left less a reserve), or None when too little is left."""
        left = self.remaining() - 10
        need = self.cfg["min_start_s"] if minimum is None else minimum
        return None if left < need else min(cap, left)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("HARNESS_CACHE", str(self.state.root / "cache"))
        if self.dry:
            env["OMP_NUM_THREADS"] = "1"
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.update(extra)
        return env

    def not_reached(self, key: str, extra: dict[str, Any] | None = None) -> None:
        self.state.item(key, dict(extra or {}, status="not reached", reason="the call's time was used up; the next call runs it"))


# ------------------------------------------------------------------------------------ one run
def simulate(ctx: Ctx, key: str, estimate: float, timeout: float, extra: dict[str, Any]) -> dict[str, Any]:
    """The rehearsal's stand-in for a run: the clock moves by the estimate (or to the run's time limit);
    GPU_SUITE_SIM_FAIL (comma-separated keys) makes a run fail the same way, to rehearse the stop rule."""
    failing = {k for k in os.environ.get("GPU_SUITE_SIM_FAIL", "").split(",") if k}
    if key in failing:
        ctx.clock.spend(min(estimate, timeout) / 3)
        return dict(extra, status="failed", reason="exit 1 (simulated)", rc=1, log_tail="harness: error: simulated failure")
    ctx.clock.spend(min(estimate, timeout))
    if estimate > timeout:
        return dict(extra, status="timeout", reason=f"simulated: {estimate} s estimated, {timeout:.0f} s left", estimate_s=estimate)
    return dict(extra, status="simulated", estimate_s=estimate)


def run_train(
    ctx: Ctx, key: str, cfg: dict[str, Any], cap: float, warm: int, estimate: float, extra: dict[str, Any], minimum: float | None = None
) -> dict[str, Any] | None:
    """One harness.train run from a config dict (one process; world 1), recorded under `key`; its plan submitted."""
    extra = dict(extra, world=1, config=cfg, estimate_s=estimate)
    if ctx.state.settled(key):
        return None
    timeout = ctx.budget(cap, minimum)
    if timeout is None:
        ctx.not_reached(key, extra)
        return None
    if ctx.sim:
        item = simulate(ctx, key, estimate, timeout, extra)
        ctx.state.item(key, item)
        return item
    work = ctx.runs / key.replace("/", "__")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    cfg = json.loads(json.dumps(cfg))
    cfg["output_dir"] = str(work / "run")
    config = work / "config.json"
    write_config(config, cfg)
    res = launch([ctx.py, "-m", "harness.train", "--config", str(config)], work / "log.txt", timeout, ctx.env(), sampler_gpu=not ctx.dry)
    res["log_path"] = work / "log.txt"
    item = finish_run(ctx.state.root, res, work / "run", warm, extra)
    marker = cpu_adam_marker(res["log_text"], str(cfg.get("strategy", "")), ctx.dry)
    if marker:
        item["cpu_adam"] = marker
    ctx.state.item(key, item)
    submit_plan(ctx, key, config, 1)
    return item


def submit_plan(ctx: Ctx, key: str, config: Path, world: int) -> None:
    """harness.plan for a config that ran, on the host's cores beside the next GPU run."""
    timeout = min(ctx.cfg["plan_timeout_s"], max(10.0, ctx.remaining() - 5))
    ctx.plans.append(ctx.pool.submit(run_plan, ctx, key, config, world, timeout))


def run_plan(ctx: Ctx, key: str, config: Path, world: int, timeout: float) -> None:
    out = config.parent / "plan.json"
    mem = f"{ctx.gpu_mem_mib}MiB" if ctx.gpu_mem_mib else "80GiB"
    cmd = [ctx.py, "-m", "harness.plan", "--config", str(config), "--gpus", str(world), "--gpu-mem", mem, "--json", str(out)]
    if ctx.dry:
        cmd += ["--target", "cpu"]
    # The planner needs no GPU; hide it so it cannot touch the device the training run is using.
    env = ctx.env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1" if ctx.dry else "2")
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = None, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    (config.parent / "plan.txt").write_text(f"$ {' '.join(cmd)}\n{text}")
    item: dict[str, Any] = {"rc": rc, "gpu_mem": mem, "world": world, "seconds": round(time.time() - t0, 1), "command": " ".join(cmd)}
    if rc in (0, 10) and out.exists():  # harness.plan: 0 fits, 10 does not fit (harness/errors.py); both wrote the JSON
        data = json.loads(out.read_text())
        keep = ("peak_bytes", "device_need_bytes", "allowance_bytes", "peak_moment", "fits", "verdict", "host_bytes_per_rank")
        item.update(status="ok", **{k: data.get(k) for k in keep})
    else:
        item.update(status="failed", reason=f"harness.plan exit {rc}", log_tail=tail(text, 1500))
    ctx.state.item(f"plan/{key}", item)


def finish_plans(ctx: Ctx) -> None:
    """The plans still running get what is left of the call (each has its own time limit too)."""
    for fut in ctx.plans:
        try:
            fut.result(timeout=max(1.0, ctx.remaining()))
        except Exception as exc:
            print(f"[gpu_suite] a plan did not finish in the call: {type(exc).__name__}: {exc}", flush=True)
    ctx.pool.shutdown(wait=False, cancel_futures=True)
    ctx.prep.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------ the parts
def table_config(ctx: Ctx, model: str, strategy: str) -> dict[str, Any]:
    c = ctx.cfg
    cfg: dict[str, Any] = {
        "model": {"name": model},
        "data": dict(c["table_data"]),
        "strategy": strategy,
        "precision": c["table_precision"],
        "micro_batch_size": c["table_micro"],
        "grad_accum": 1,
        "steps": c["table_steps"],
        "eval_batches": c["table_eval_batches"],
        "optim": {"lr": 1.0e-3, "warmup_steps": 2},
        "logging": {"wandb": False, "progress": False, "plots": False},
        # track: max_memory_allocated every step; the category split (slow) only on steps 0 and 1
        "memory": {"track": True, "track_every": 1000},
    }
    if ctx.dry and not ctx.sim:
        cfg["device"] = "cpu"
    return cfg


def part_strategies(ctx: Ctx, strategies: list[str]) -> None:
    model = model_for(ctx, "table")
    keys = [f"strategies/{s}/w1" for s in strategies]
    if model is None:
        for key in keys:
            ctx.state.item(key, {"status": "skipped", "reason": "no saved model (see item saved_model)"})
        return
    rule = FailureRule()
    for strategy, key in zip(strategies, keys, strict=True):
        cfg = table_config(ctx, model, strategy)
        if rule.stopped:
            ctx.state.item(key, {"status": "skipped", "reason": rule.reason(), "world": 1, "config": cfg})
        elif ctx.dry and not ctx.sim and strategy in NEEDS_GPU:
            ctx.state.item(key, {"status": "skipped", "reason": "needs a GPU (CPUOffloadPolicy needs an accelerator)", "config": cfg})
        else:
            est = ESTIMATE_S["strategy_offload" if "offload" in strategy else "strategy"]
            rule.note(run_train(ctx, key, cfg, ctx.cfg["table_run_cap_s"], 2, est, {"strategy": strategy}))


def part_throughput(ctx: Ctx, variant: str) -> None:
    """llama-1.6b (saved once, loaded by path) in bf16, one process: tokens/s and the harness's MFU."""
    c, memory = ctx.cfg, THROUGHPUT_VARIANTS[variant]
    model = model_for(ctx, "tp") or c["tp_model"]  # the preset when saving failed: the run then pays the host init
    for micro in (c["tp_micro"], c["tp_micro"] // 2):
        name = f"{'eager' if not memory else 'compile=' + memory['compile']}, micro {micro}"
        cfg = {
            "model": {"name": model},
            "data": dict(c["tp_data"]),
            "strategy": "ddp",
            "precision": "bf16",
            "micro_batch_size": micro,
            "grad_accum": 1,
            "steps": c["tp_steps"],
            "eval_batches": 2,
            "optim": {"lr": 1.0e-3, "warmup_steps": 2},
            "logging": {"wandb": False, "progress": False, "plots": False},
            "memory": dict({"track": True, "track_every": 1000}, **memory),
        }
        if ctx.dry and not ctx.sim:
            cfg["device"] = "cpu"
        minimum = c["min_compiled_s"] if memory else None
        key = f"throughput/{name}"
        item = run_train(
            ctx,
            key,
            cfg,
            c["tp_run_cap_s"],
            c["tp_warm"],
            ESTIMATE_S[f"throughput_{variant}"],
            {"candidate": name},
            minimum,
        ) or ctx.state.get(key)  # an earlier call's, on this machine
        # The planner predicts ~58 GiB for micro 8; if the allocator disagrees, once more at half the micro-batch.
        if not (item and item.get("status") == "failed" and "out of memory" in item.get("log_tail", "").lower()):
            return


def load_matrix_runs(path: Path) -> list[dict[str, Any]]:
    """The `runs` list of a matrix YAML. PyYAML when importable (it is on both machines), else a subprocess."""
    try:
        import yaml

        return list((yaml.safe_load(path.read_text()) or {}).get("runs") or [])
    except ImportError:
        code = "import json,sys,yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))['runs']))"
        out = subprocess.run([os.environ.get("PY") or sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)


def matrix_rows(compiled: bool) -> list[str]:
    """The rows to run: GPU_SUITE_MATRIX_ROWS / GPU_SUITE_MATRIX_COMPILED_ROWS (';'-separated names,
    in order), else the eager rows in EAGER_ROWS' order, or every compiled row of the yaml."""
    names = {}
    for item in load_matrix_runs(MATRIX_YAML):
        mem = (item.get("overrides") or {}).get("memory") or {}
        names[item["name"]] = bool(mem.get("compile")) or mem.get("activation_memory_budget") is not None
    chosen = os.environ.get("GPU_SUITE_MATRIX_COMPILED_ROWS" if compiled else "GPU_SUITE_MATRIX_ROWS")
    rows = (
        [r.strip() for r in chosen.split(";") if r.strip()]
        if chosen
        else (EAGER_ROWS if not compiled else [n for n, c in names.items() if c])
    )
    unknown = [r for r in rows if r not in names]
    if unknown:
        raise ValueError(f"matrix rows not in {MATRIX_YAML.name}: {unknown}")
    return rows


def row_dir(name: str) -> str:
    return name.replace(" ", "_").replace("/", "-")  # harness.experiments' own naming


def part_matrix(ctx: Ctx, compiled: bool) -> None:
    out = ctx.state.root / "matrix"
    out.mkdir(exist_ok=True)
    model = model_for(ctx, "tp")
    sets = [*ctx.cfg["matrix_set"], *([f"model.name={model}"] if model else [])]
    rule = FailureRule()
    for name in matrix_rows(compiled):
        key, extra = f"matrix/{name}", {"compiled": compiled, "matrix_set": sets}
        if ctx.state.settled(key):
            continue
        if rule.stopped:
            ctx.state.item(key, dict(extra, status="skipped", reason=rule.reason()))
            continue
        timeout = ctx.budget(
            ctx.cfg["matrix_compiled_cap_s" if compiled else "matrix_eager_cap_s"], ctx.cfg["min_compiled_s"] if compiled else None
        )
        if timeout is None:
            ctx.not_reached(key, extra)
            continue
        est = ESTIMATE_S["matrix_compiled" if compiled else ("matrix_fp32" if "fp32" in name else "matrix_eager")]
        extra["estimate_s"] = est
        item = simulate(ctx, key, est, timeout, extra) if ctx.sim else run_matrix_row(ctx, out, name, sets, timeout, extra)
        ctx.state.item(key, item)
        rule.note(item)


def run_matrix_row(ctx: Ctx, out: Path, name: str, sets: list[str], timeout: float, extra: dict[str, Any]) -> dict[str, Any]:
    """One row as its own `harness.experiments --only ROW` process, so one row's failure or time limit is its own."""
    rdir = out / row_dir(name)
    if rdir.exists():
        shutil.rmtree(rdir)
    cmd = [ctx.py, "-m", "harness.experiments", str(MATRIX_YAML), "--out", str(out), "--only", name, "--set", *sets]
    log = ctx.runs / f"matrix__{row_dir(name)}.log"
    res = launch(cmd, log, timeout, ctx.env(), sampler_gpu=not ctx.dry)
    res["log_path"] = log
    item = finish_run(ctx.state.root, res, rdir / "run", 2, extra)
    try:
        summary = json.loads((out / "results.json").read_text())
        item["experiments_row"] = next((r for r in summary if r.get("name") == name), None)
    except (OSError, json.JSONDecodeError):
        item["experiments_row"] = None
    if (rdir / "config.yaml").exists():
        submit_plan(ctx, f"matrix/{name}", rdir / "config.yaml", 1)
    return item


def part_matrix_table(ctx: Ctx) -> None:
    """harness.experiments' own table over every row that finished in this state folder (no row is re-run)."""
    out = ctx.state.root / "matrix"
    done = [name for name in matrix_rows(False) + matrix_rows(True) if (out / row_dir(name) / "done.json").exists()]
    if not done:
        ctx.state.item("matrix_table", {"status": "skipped", "reason": "no finished matrix row in this state folder"})
        return
    cmd = [ctx.py, "-m", "harness.experiments", str(MATRIX_YAML), "--out", str(out), "--only", ",".join(done), "--resume"]
    cmd += ["--set", *ctx.cfg["matrix_set"]]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=ctx.env(), capture_output=True, text=True, timeout=max(10, ctx.remaining() - 5))
    except subprocess.TimeoutExpired:
        ctx.state.item("matrix_table", {"status": "timeout", "rows": done})
        return
    ok = proc.returncode == 0 and (out / "results.md").exists()
    result = {"results_md": (out / "results.md").read_text()} if ok else {"log_tail": tail(proc.stdout + proc.stderr)}
    ctx.state.item("matrix_table", dict(result, status="ok" if ok else "failed", rows=done))
