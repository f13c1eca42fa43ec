"""Issue 16's GPU half, one part at a time: driven by benchmarks/gpu_suite.sh (read that first).

    python benchmarks/gpu_suite.py --state runs/gpu_suite --part strategies --deadline EPOCH [--dry-run]
    python benchmarks/gpu_suite.py --make-model DIR --size 300m|tiny

Everything goes through the command-line entry points (``python -m harness.train``,
``python -m torch.distributed.run harness/train.py``, ``python -m harness.plan``,
``python -m harness.experiments``) and the files a run writes (``metrics.jsonl``,
``state_bytes/rank*.json``): no harness internals are imported, and this process never
imports torch (it must not hold a CUDA context while it samples device memory).

Parts (each records items into ``<state>/results.json``; a failing item never stops the part):
  facts            device, driver, torch/CUDA/DeepSpeed versions, setup outcome
  strategies       notes/core.md's strategy table on the GPU (world 1, and world N when N GPUs
                   are visible) on a ~320M Llama saved as safetensors: per-rank bytes,
                   max_memory_allocated, tokens/s, loss; fsdp_offload and DeepSpeed CPU Adam
                   (zero2_offload / zero3_offload) on the GPU; the load-phase device peak of
                   every run (the saved model is loaded from disk: fsdp and zero3 rows are the
                   sharded loads); harness.plan for each config
  throughput       llama-1.6b bf16 tokens/s and MFU (eager, compile=block, compile=model)
  matrix_compiled  rows of experiments/peak_memory_gpu.yaml that compile
  matrix_eager     the other rows
  matrix_table     the harness's own combined table over the rows that finished
Every run's device memory is sampled from outside (NVML, else nvidia-smi; RSS of the process
tree in --dry-run) so the load phase (process start .. the metrics 'start' record, written
once the engine is built) and the training phase are separated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_report  # noqa: E402  (same folder)

# Run order: the sharded loads (fsdp, zero3) and the offload runs the issue asks for come first, so a short
# budget cuts the least important rows; the report orders the table as notes/core.md does.
STRATEGIES = ["ddp", "fsdp", "zero3", "fsdp_offload", "zero2_offload", "zero3_offload", "zero1", "zero2", "fsdp_grad_op"]
NEEDS_GPU = {"fsdp_offload"}  # refused before launch on a CPU-only machine (CPUOffloadPolicy needs an accelerator)
MATRIX_YAML = REPO / "experiments" / "peak_memory_gpu.yaml"
GIB = 2**30

# Sizes. GPU: what the issue asks for. Dry run: the same code paths on tiny models, 2 steps, CPU.
GPU = {
    "table_model": "300m",
    "table_data": {"seq_len": 1024, "vocab_size": 32000, "max_tokens": 2000000},
    "table_precision": "bf16",
    "table_micro": 8,
    "table_steps": 8,
    "table_eval_batches": 4,
    "table_run_cap_s": 150,
    "tp_model": "llama-1.6b",
    "tp_data": {"seq_len": 2048, "vocab_size": 32000, "max_tokens": 2000000},  # = the matrix's data: one cache
    "tp_steps": 12,
    "tp_warm": 4,
    "tp_run_cap_s": 240,
    # GPU_SUITE_MATRIX_SET (space-separated key=value) replaces this, e.g. adding data.seq_len=1024 if fp32 rows run out of memory
    "matrix_set": os.environ.get("GPU_SUITE_MATRIX_SET", "steps=8 memory.track_every=1000").split(),
    "matrix_eager_cap_s": 180,
    "matrix_compiled_cap_s": 300,
    "min_start_s": 45,
    "min_compiled_s": 150,
    "plan_timeout_s": 240,
    "plan_workers": 3,
}
DRY = {
    "table_model": "tiny",
    "table_data": {"seq_len": 64, "vocab_size": 2048, "max_tokens": 50000},
    "table_precision": "fp32",
    "table_micro": 2,
    "table_steps": 2,
    "table_eval_batches": 1,
    "table_run_cap_s": 120,
    "tp_model": "tiny-llama",
    "tp_data": {"seq_len": 64, "vocab_size": 2048, "max_tokens": 50000},
    "tp_steps": 3,
    "tp_warm": 1,
    "tp_run_cap_s": 120,
    "matrix_set": [
        "model.name=tiny-llama",
        "data.seq_len=64",
        "data.vocab_size=2048",
        "data.max_tokens=50000",
        "micro_batch_size=2",
        "steps=2",
        "eval_batches=1",
        "device=cpu",
        "memory.track_every=1000",
    ],
    "matrix_eager_cap_s": 150,
    "matrix_compiled_cap_s": 150,
    "min_start_s": 15,
    "min_compiled_s": 15,
    "plan_timeout_s": 180,
    "plan_workers": 1,
}
# The dry run runs the eager rows of the matrix; compiled rows need minutes of inductor on 2 CPU cores.


# ---------------------------------------------------------------------------------------- state
class State:
    """``<state>/results.json``: {"meta", "parts": {name: {...}}, "items": {key: {...}}}, written atomically."""

    def __init__(self, root: Path, dry: bool) -> None:
        self.root, self.dry = root, dry
        self.path = root / "results.json"
        self.lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"meta": {}, "parts": {}, "items": {}}
        self.data["meta"]["dry_run"] = dry

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def item(self, key: str, value: dict[str, Any]) -> None:
        with self.lock:
            value = dict(value, key=key, recorded_at=time.strftime("%Y-%m-%d %H:%M:%S"))
            self.data["items"][key] = value
            self.save()
        status = value.get("status")
        extra = value.get("reason") or ""
        print(f"[gpu_suite] {key}: {status}{' - ' + extra if extra else ''}", flush=True)

    def part(self, name: str, **fields: Any) -> None:
        with self.lock:
            self.data["parts"].setdefault(name, {}).update(fields)
            self.save()

    def get(self, key: str) -> dict[str, Any] | None:
        return self.data["items"].get(key)


class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.dry = args.dry_run
        self.cfg = DRY if self.dry else GPU
        self.state = State(Path(args.state).resolve(), self.dry)
        self.py = os.environ.get("PY") or sys.executable
        self.deadline = args.deadline or (time.time() + 600)
        self.runs = self.state.root / "runs"
        self.runs.mkdir(exist_ok=True)
        self.ngpu, self.gpu_mem_mib, self.gpu_name = gpu_inventory()
        self.plans: list[Future] = []
        self.pool = ThreadPoolExecutor(max_workers=self.cfg["plan_workers"])

    def remaining(self) -> float:
        return self.deadline - time.time()

    def budget(self, cap: float, minimum: float | None = None) -> float | None:
        """Seconds to give the next run: min(cap, time left less a reserve), or None when too little is left."""
        left = self.remaining() - 15
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


def gpu_inventory() -> tuple[int, int | None, str | None]:
    """(count, memory of GPU 0 in MiB, name of GPU 0) from nvidia-smi; (0, None, None) without one."""
    if shutil.which("nvidia-smi") is None:
        return 0, None, None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0, None, None
    rows = [r.split(",") for r in out.strip().splitlines() if r.strip()]
    if not rows:
        return 0, None, None
    return len(rows), int(float(rows[0][1])), rows[0][0].strip()


# ------------------------------------------------------------------------------ memory sampler
class MemSampler(threading.Thread):
    """Device memory in use (NVML or nvidia-smi: every process, CUDA context and allocator cache
    included; max over GPUs) or, without a GPU, the RSS of the launched process tree."""

    def __init__(self, pid: int | None, gpu: bool, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self._halt = threading.Event()
        self.source = "none"
        self._read = None
        if gpu:
            try:
                import pynvml  # nvidia-ml-py: on the GPU image

                pynvml.nvmlInit()
                handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
                self._read = lambda: max(int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles)
                self.source = "NVML memory.used (all processes; context + allocator cache included)"
            except Exception:
                self._read = self._smi
                self.source = "nvidia-smi memory.used (all processes; context + allocator cache included)"
                self.interval = max(interval, 0.25)
        else:
            try:
                import psutil

                self._psutil = psutil
                self._read = self._rss
                self.source = "RSS of the process tree (dry run, CPU)"
            except ImportError:
                self._read = None

    @staticmethod
    def _smi() -> int:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        ).stdout
        return max(int(float(x)) for x in out.split()) * 2**20

    def _rss(self) -> int:
        if self.pid is None:
            return 0
        try:
            root = self._psutil.Process(self.pid)
            procs = [root] + root.children(recursive=True)
        except self._psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except self._psutil.Error:
                pass
        return total

    def read_once(self) -> int | None:
        if self._read is None:
            return None
        try:
            return self._read()
        except Exception:
            return None

    def run(self) -> None:
        while not self._halt.is_set():
            value = self.read_once()
            if value is not None:
                self.samples.append((time.time(), value))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def summary(self, baseline: int | None, boundary: float | None) -> dict[str, Any]:
        if not self.samples:
            return {"source": self.source, "samples": 0}
        load = [v for t, v in self.samples if boundary is not None and t < boundary]
        train = [v for t, v in self.samples if boundary is not None and t >= boundary]
        peak = max(v for _, v in self.samples)
        return {
            "source": self.source,
            "samples": len(self.samples),
            "baseline_bytes": baseline,
            "peak_bytes": peak,
            "load_peak_bytes": max(load) if load else None,
            "run_peak_bytes": max(train) if train else None,
        }


# --------------------------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(path: Path, data: dict[str, Any]) -> None:
    """A run config as JSON (the harness reads YAML or JSON; this process does not need PyYAML)."""
    path.write_text(json.dumps(data, indent=1) + "\n")


ACTIVE_GROUPS: set[int] = set()  # process groups of the runs in flight, killed if this part is itself stopped


def _on_term(signum: int, frame: Any) -> None:
    for pgid in list(ACTIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"[gpu_suite] stopped by signal {signum}; killed {len(ACTIVE_GROUPS)} run(s) in flight", flush=True)
    os._exit(124)


def launch(ctx: Ctx, cmd: list[str], log: Path, timeout: float, env: dict[str, str], sampler_gpu: bool, cwd: Path = REPO) -> dict[str, Any]:
    """Run a command in its own session, log its output with timestamps, sample memory; kill the group at timeout."""
    baseline_sampler = MemSampler(None, sampler_gpu)
    baseline = baseline_sampler.read_once() if sampler_gpu else 0
    start = time.time()
    banner_at: list[float] = []
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, bufsize=1
        )
        ACTIVE_GROUPS.add(proc.pid)
        sampler = MemSampler(proc.pid, sampler_gpu)
        sampler.start()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                now = time.time()
                if not banner_at and re.match(r"\[harness\] \S+ \(\w+\) x\d+ on ", line):
                    banner_at.append(now)
                f.write(f"[{now - start:8.2f}] {line}")
                f.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    continue
        reader.join(timeout=10)
        sampler.stop()
        ACTIVE_GROUPS.discard(proc.pid)
        wall = time.time() - start
        f.write(f"[{wall:8.2f}] exit {proc.returncode}{f' (timed out after {timeout:.0f} s)' if timed_out else ''}\n")
    text = log.read_text(errors="replace")
    return {
        "rc": proc.returncode,
        "timed_out": timed_out,
        "wall_s": round(wall, 1),
        "log_text": text,
        "sampler": sampler,
        "baseline": baseline,
        "banner_at": banner_at[0] if banner_at else None,
    }


def read_metrics(out_dir: Path, warm: int) -> dict[str, Any]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    start = next((r for r in rows if r.get("kind") == "start"), {})
    train = [r for r in rows if r.get("kind") == "train" or ("train/loss" in r and r.get("kind") is None)]
    evals = [r for r in rows if "eval/loss" in r]
    steady = train[warm:] if len(train) > warm else train

    def med(key: str) -> float | None:
        vals = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    def mx(key: str) -> float | None:
        vals = [r[key] for r in train if isinstance(r.get(key), (int, float))]
        return max(vals) if vals else None

    return {
        "start_time": start.get("time"),
        "device_name": start.get("device_name"),
        "world_size": start.get("world_size"),
        "flops_per_token": start.get("flops_per_token"),
        "peak_flops_per_device": start.get("peak_flops_per_device"),
        "steps_logged": len(train),
        "timed_steps": len(steady),
        "tokens_per_s": med("perf/tokens_per_s"),
        "tokens_per_s_per_device": med("perf/tokens_per_s_per_device"),
        "samples_per_s": med("perf/samples_per_s"),
        "step_time_s": med("perf/step_time_s"),
        "mfu": med("perf/mfu"),
        "max_allocated_bytes": mx("memory/max_allocated_bytes"),
        "max_reserved_bytes": mx("memory/max_reserved_bytes"),
        "tracked_total_peak_bytes": mx("memory/total_peak_bytes"),
        "final_loss": train[-1].get("train/loss") if train else None,
        "eval_loss": evals[-1].get("eval/loss") if evals else None,
        "eval_perplexity": evals[-1].get("eval/perplexity") if evals else None,
        "last_time": rows[-1].get("time") if rows else None,
    }


def read_state_bytes(out_dir: Path) -> dict[str, Any]:
    out = {}
    for p in sorted((out_dir / "state_bytes").glob("rank*.json")):
        try:
            out[p.stem] = json.loads(p.read_text()).get("peak")
        except (OSError, json.JSONDecodeError):
            pass
    return out


def cpu_adam_marker(log_text: str, strategy: str, dry: bool) -> str | None:
    if not strategy.startswith("zero") or "offload" not in strategy:
        return None
    if dry:
        return "n/a on CPU (torch AdamW: host and device are one memory)"
    m = re.search(r"DeepSpeedCPUAdam unavailable \(([^)]*)\)", log_text)
    if m:
        return f"fallback to torch AdamW on CPU ({m.group(1)})"
    if re.search(r"Adam Optimizer #\d+ is created", log_text) or "DeepSpeedCPUAdam" in log_text:
        return "DeepSpeedCPUAdam"
    return "unknown (no marker in the log)"


def tail(text: str, n: int = 2500) -> str:
    return text[-n:]


def finish_run(ctx: Ctx, key: str, res: dict[str, Any], out_dir: Path, warm: int, extra: dict[str, Any]) -> dict[str, Any]:
    metrics = read_metrics(out_dir, warm)
    boundary = metrics.get("start_time") or res["banner_at"]
    mem = res["sampler"].summary(res["baseline"], boundary)
    mem["load_boundary"] = (
        "metrics.jsonl 'start' record (engine built)"
        if metrics.get("start_time")
        else "'[harness] ...' banner line"
        if res["banner_at"]
        else "not found"
    )
    status = "timeout" if res["timed_out"] else ("ok" if res["rc"] == 0 and metrics.get("steps_logged") else "failed")
    item = dict(
        extra,
        status=status,
        rc=res["rc"],
        wall_s=res["wall_s"],
        metrics=metrics,
        device_memory=mem,
        state_bytes=read_state_bytes(out_dir),
        log=str(res["log_path"].relative_to(ctx.state.root)),
    )
    if status != "ok":
        item["reason"] = ("timed out" if res["timed_out"] else f"exit {res['rc']}") + "; log tail in 'log_tail'"
        item["log_tail"] = tail(res["log_text"])
    return item


def done_already(ctx: Ctx, key: str) -> bool:
    """An item finished in an earlier call on this (still warm) machine is not run again: stages resume."""
    prior = ctx.state.get(key)
    if prior and prior.get("status") == "ok":
        print(f"[gpu_suite] {key}: done earlier in this state folder", flush=True)
        return True
    return False


def run_train(
    ctx: Ctx,
    key: str,
    cfg: dict[str, Any],
    world: int,
    cap: float,
    warm: int,
    extra: dict[str, Any] | None = None,
    plan: bool = True,
    minimum: float | None = None,
) -> dict[str, Any] | None:
    """One harness.train run (torch.distributed.run when world > 1) from a config dict; recorded under `key`."""
    extra = dict(extra or {}, world=world, config=cfg)
    if done_already(ctx, key):
        return None
    timeout = ctx.budget(cap, minimum)
    if timeout is None:
        ctx.state.item(key, dict(extra, status="skipped", reason="not run: the stage's time budget was used up"))
        return None
    work = ctx.runs / key.replace("/", "__")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    cfg = json.loads(json.dumps(cfg))
    cfg["output_dir"] = str(work / "run")
    config = work / "config.json"
    write_config(config, cfg)
    if world > 1:
        cmd = [
            ctx.py,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={world}",
            f"--master_port={free_port()}",
            str(REPO / "harness" / "train.py"),
            "--config",
            str(config),
        ]
    else:
        cmd = [ctx.py, "-m", "harness.train", "--config", str(config)]
    res = launch(ctx, cmd, work / "log.txt", timeout, ctx.env(), sampler_gpu=not ctx.dry)
    res["log_path"] = work / "log.txt"
    item = finish_run(ctx, key, res, work / "run", warm, extra)
    marker = cpu_adam_marker(res["log_text"], str(cfg.get("strategy", "")), ctx.dry)
    if marker:
        item["cpu_adam"] = marker
    ctx.state.item(key, item)
    if plan:
        submit_plan(ctx, key, config, world)
    return item


# ---------------------------------------------------------------------------------- planner
def submit_plan(ctx: Ctx, key: str, config: Path, world: int) -> None:
    ctx.plans.append(ctx.pool.submit(run_plan, ctx, key, config, world))


def run_plan(ctx: Ctx, key: str, config: Path, world: int) -> None:
    out = config.parent / "plan.json"
    mem = f"{ctx.gpu_mem_mib}MiB" if ctx.gpu_mem_mib else "80GiB"
    cmd = [ctx.py, "-m", "harness.plan", "--config", str(config), "--gpus", str(world), "--gpu-mem", mem, "--json", str(out)]
    if ctx.dry:
        cmd += ["--target", "cpu"]
    # The planner needs no GPU; hide it so it cannot touch the device the training run is using.
    env = ctx.env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1" if ctx.dry else "2")
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.cfg["plan_timeout_s"])
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = None, f"timed out after {ctx.cfg['plan_timeout_s']} s\n{exc.stdout or ''}{exc.stderr or ''}"
    (config.parent / "plan.txt").write_text(f"$ {' '.join(cmd)}\n{text}")
    item: dict[str, Any] = {"rc": rc, "gpu_mem": mem, "world": world, "seconds": round(time.time() - t0, 1), "command": " ".join(cmd)}
    if rc in (0, 10) and out.exists():  # harness.plan: 0 fits, 10 does not fit (harness/errors.py); both wrote the JSON
        data = json.loads(out.read_text())
        item.update(
            status="ok",
            peak_bytes=data.get("peak_bytes"),
            device_need_bytes=data.get("device_need_bytes"),
            allowance_bytes=data.get("allowance_bytes"),
            peak_moment=data.get("peak_moment"),
            fits=data.get("fits"),
            verdict=data.get("verdict"),
            host_bytes_per_rank=data.get("host_bytes_per_rank"),
        )
    else:
        item.update(status="failed", reason=f"harness.plan exit {rc}", log_tail=tail(text, 1500))
    ctx.state.item(f"plan/{key}", item)


def wait_plans(ctx: Ctx) -> None:
    for fut in ctx.plans:
        try:
            fut.result(timeout=max(5.0, ctx.remaining() - 5))
        except Exception as exc:
            print(f"[gpu_suite] a plan did not finish: {type(exc).__name__}: {exc}", flush=True)
    ctx.pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------ parts
def part_facts(ctx: Ctx) -> None:
    facts: dict[str, Any] = {
        "gpus": ctx.ngpu,
        "gpu_name": ctx.gpu_name,
        "gpu_memory_mib": ctx.gpu_mem_mib,
        "cpu_count": os.cpu_count(),
        "python": ctx.py,
    }
    if shutil.which("nvidia-smi"):
        for name, args in (
            ("nvidia_smi_L", ["-L"]),
            ("nvidia_smi_query", ["--query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm", "--format=csv"]),
        ):
            try:
                facts[name] = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30).stdout.strip()
            except (OSError, subprocess.TimeoutExpired) as exc:
                facts[name] = f"failed: {exc}"
    probe = (
        "import json, platform, torch\n"
        "d = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'cuda_available': torch.cuda.is_available(),"
        " 'python_version': platform.python_version()}\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d.update(device=torch.cuda.get_device_name(0), capability='%d.%d' % (p.major, p.minor), sms=p.multi_processor_count,"
        " total_memory=p.total_memory, bf16=torch.cuda.is_bf16_supported(), cudnn=torch.backends.cudnn.version())\n"
        "    try:\n"
        "        v = torch.cuda.nccl.version()\n"
        "        d['nccl'] = '.'.join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)\n"
        "    except Exception as e:\n"
        "        d['nccl'] = 'unknown: %s' % type(e).__name__\n"
        "for m in ('deepspeed', 'transformers', 'accelerate', 'datasets', 'triton', 'pydantic'):\n"
        "    try:\n"
        "        d[m] = __import__(m).__version__\n"
        "    except Exception as e:\n"
        "        d[m] = 'not importable: %s' % type(e).__name__\n"
        "print(json.dumps(d))\n"
    )
    try:
        proc = subprocess.run([ctx.py, "-c", probe], capture_output=True, text=True, timeout=120, env=ctx.env())
        facts.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    except Exception as exc:
        facts["probe_error"] = f"{type(exc).__name__}: {exc}"
    try:
        mem = [line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")]
        facts["host_memory"] = mem[0].split(":", 1)[1].strip() if mem else None
    except OSError:
        pass
    setup = ctx.state.root / "setup.json"
    if setup.exists():
        facts["setup"] = json.loads(setup.read_text())
    ctx.state.data["meta"]["device"] = facts
    ctx.state.item("facts", dict(facts, status="ok"))
    record_cpu_adam_build(ctx)


def record_cpu_adam_build(ctx: Ctx) -> None:
    """The background DeepSpeed CPU Adam JIT build started by gpu_suite.sh (its rc file appears when it ends)."""
    if ctx.dry:
        ctx.state.item("setup/cpu_adam_build", {"status": "skipped", "reason": "dry run: DeepSpeedCPUAdam is only used with a GPU"})
        return
    rc_file, log = ctx.state.root / "cpu_adam_build.rc", ctx.state.root / "logs" / "cpu_adam_build.log"
    if not rc_file.exists():
        ctx.state.item(
            "setup/cpu_adam_build",
            {
                "status": "running" if log.exists() else "not started",
                "log_tail": tail(log.read_text(errors="replace"), 1500) if log.exists() else None,
            },
        )
        return
    rc = rc_file.read_text().strip()
    ctx.state.item(
        "setup/cpu_adam_build",
        {
            "status": "ok" if rc == "0" else "failed",
            "rc": rc,
            "log_tail": tail(log.read_text(errors="replace"), 1500) if log.exists() else None,
        },
    )


def ensure_model(ctx: Ctx) -> Path | None:
    size = ctx.cfg["table_model"]
    target = ctx.state.root / "models" / f"llama-{size}"
    if (target / "config.json").exists():
        return target
    timeout = ctx.budget(240, minimum=20)
    if timeout is None:
        ctx.state.item("saved_model", {"status": "skipped", "reason": "not run: the stage's time budget was used up"})
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    proc = subprocess.run(
        [ctx.py, str(Path(__file__).resolve()), "--make-model", str(target), "--size", size],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ctx.env(CUDA_VISIBLE_DEVICES=""),
    )
    ok = proc.returncode == 0 and (target / "config.json").exists()
    info = json.loads(proc.stdout.strip().splitlines()[-1]) if ok else {}
    ctx.state.item(
        "saved_model",
        dict(
            info,
            status="ok" if ok else "failed",
            path=str(target),
            seconds=round(time.time() - t0, 1),
            **({} if ok else {"log_tail": tail(proc.stdout + proc.stderr)}),
        ),
    )
    return target if ok else None


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
    if ctx.dry:
        cfg["device"] = "cpu"
    return cfg


def part_strategies(ctx: Ctx) -> None:
    model = ensure_model(ctx)
    if model is None:
        for s in STRATEGIES:
            ctx.state.item(f"strategies/{s}/w1", {"status": "skipped", "reason": "no saved model (see item saved_model)"})
        return
    worlds = [1] + ([ctx.ngpu] if ctx.ngpu > 1 else [])
    if os.environ.get("GPU_SUITE_WORLDS"):  # e.g. "2": a world-2 check of the plumbing on CPU, or a subset on a GPU
        worlds = [int(w) for w in os.environ["GPU_SUITE_WORLDS"].split(",")]
    strategies = os.environ.get("GPU_SUITE_STRATEGIES", ",".join(STRATEGIES)).split(",")
    for world in worlds:
        for strategy in strategies:
            key = f"strategies/{strategy}/w{world}"
            cfg = table_config(ctx, str(model), strategy)
            if ctx.dry and strategy in NEEDS_GPU:
                ctx.state.item(
                    key,
                    {"status": "skipped", "reason": "needs a GPU (CPUOffloadPolicy needs an accelerator)", "world": world, "config": cfg},
                )
                continue
            run_train(ctx, key, cfg, world, ctx.cfg["table_run_cap_s"], warm=2, extra={"strategy": strategy})
    record_cpu_adam_build(ctx)
    wait_plans(ctx)


def part_throughput(ctx: Ctx) -> None:
    c = ctx.cfg
    candidates = [  # (name, memory overrides, micro-batch, least seconds worth starting); the best by MFU is reported
        ("eager, micro 8", {}, 8, None),
        ("compile=block, micro 8", {"compile": "block"}, 8, 120),
        ("compile=model, micro 8", {"compile": "model"}, 8, 180),
    ]
    queue = list(candidates)
    while queue:
        name, memory, micro, minimum = queue.pop(0)
        key = f"throughput/{name}"
        cfg = {
            "model": {"name": c["tp_model"]},
            "data": dict(c["tp_data"]),
            "strategy": "ddp",
            "precision": "bf16",
            "micro_batch_size": micro if not ctx.dry else 2,
            "grad_accum": 1,
            "steps": c["tp_steps"],
            "eval_batches": 2,
            "optim": {"lr": 1.0e-3, "warmup_steps": 2},
            "logging": {"wandb": False, "progress": False, "plots": False},
            "memory": dict({"track": True, "track_every": 1000}, **memory),
        }
        if ctx.dry:
            cfg["device"] = "cpu"
            if memory.get("compile"):
                ctx.state.item(
                    key, {"status": "skipped", "reason": "dry run: inductor on 2 CPU cores takes minutes", "config": cfg, "world": 1}
                )
                continue
        item = run_train(
            ctx, key, cfg, 1, c["tp_run_cap_s"], warm=c["tp_warm"], extra={"candidate": name}, minimum=None if ctx.dry else minimum
        )
        # The planner predicts ~58 GiB for micro 8 (fits 80 GB); if the allocator disagrees, retry this one at micro 4.
        if item and item.get("status") == "failed" and micro > 4 and "out of memory" in item.get("log_tail", "").lower():
            queue.insert(0, (name.replace(f"micro {micro}", "micro 4") + f" (micro {micro} ran out of memory)", memory, 4, minimum))
    wait_plans(ctx)


def matrix_rows() -> list[tuple[str, bool]]:
    """(name, compiled) for each row of experiments/peak_memory_gpu.yaml, read with the tolerant parser below."""
    rows = []
    for item in load_matrix_runs(MATRIX_YAML):
        mem = (item.get("overrides") or {}).get("memory") or {}
        rows.append((item["name"], bool(mem.get("compile")) or mem.get("activation_memory_budget") is not None))
    return rows


def load_matrix_runs(path: Path) -> list[dict[str, Any]]:
    """The `runs` list of a matrix YAML. PyYAML when importable (it is on both machines), else a subprocess."""
    try:
        import yaml

        return list((yaml.safe_load(path.read_text()) or {}).get("runs") or [])
    except ImportError:
        out = subprocess.run(
            [
                os.environ.get("PY") or sys.executable,
                "-c",
                "import json,sys,yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))['runs']))",
                str(path),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out)


def row_dir(name: str) -> str:
    return name.replace(" ", "_").replace("/", "-")  # harness.experiments' own naming


def part_matrix(ctx: Ctx, compiled: bool) -> None:
    out = ctx.state.root / "matrix"
    out.mkdir(exist_ok=True)
    rows = [name for name, is_compiled in matrix_rows() if is_compiled == compiled]
    cap = ctx.cfg["matrix_compiled_cap_s" if compiled else "matrix_eager_cap_s"]
    for name in rows:
        key = f"matrix/{name}"
        if ctx.dry and compiled:
            ctx.state.item(key, {"status": "skipped", "reason": "dry run: inductor on 2 CPU cores takes minutes", "compiled": compiled})
            continue
        rdir = out / row_dir(name)
        if done_already(ctx, key) and (rdir / "done.json").exists():
            continue
        timeout = ctx.budget(cap, minimum=ctx.cfg["min_compiled_s"] if compiled else None)
        if timeout is None:
            ctx.state.item(key, {"status": "skipped", "reason": "not run: the stage's time budget was used up", "compiled": compiled})
            continue
        if rdir.exists():
            shutil.rmtree(rdir)
        cmd = [ctx.py, "-m", "harness.experiments", str(MATRIX_YAML), "--out", str(out), "--only", name, "--set", *ctx.cfg["matrix_set"]]
        log = ctx.runs / f"matrix__{row_dir(name)}.log"
        res = launch(ctx, cmd, log, timeout, ctx.env(), sampler_gpu=not ctx.dry)
        res["log_path"] = log
        item = finish_run(ctx, key, res, rdir / "run", 2, {"compiled": compiled, "matrix_set": ctx.cfg["matrix_set"]})
        try:
            summary = json.loads((out / "results.json").read_text())
            item["experiments_row"] = next((r for r in summary if r.get("name") == name), None)
        except (OSError, json.JSONDecodeError):
            item["experiments_row"] = None
        ctx.state.item(key, item)
        if (rdir / "config.yaml").exists():
            submit_plan(ctx, key, rdir / "config.yaml", 1)
    wait_plans(ctx)


def part_matrix_table(ctx: Ctx) -> None:
    """harness.experiments' own table over every row that finished in this state folder (no row is re-run)."""
    out = ctx.state.root / "matrix"
    done = [name for name, _ in matrix_rows() if (out / row_dir(name) / "done.json").exists()]
    if not done:
        ctx.state.item("matrix_table", {"status": "skipped", "reason": "no finished matrix row in this state folder"})
        return
    cmd = [
        ctx.py,
        "-m",
        "harness.experiments",
        str(MATRIX_YAML),
        "--out",
        str(out),
        "--only",
        ",".join(done),
        "--resume",
        "--set",
        *ctx.cfg["matrix_set"],
    ]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=ctx.env(), capture_output=True, text=True, timeout=max(30, ctx.remaining() - 5))
        ok = proc.returncode == 0 and (out / "results.md").exists()
        ctx.state.item(
            "matrix_table",
            {
                "status": "ok" if ok else "failed",
                "rows": done,
                "results_md": (out / "results.md").read_text() if ok else None,
                **({} if ok else {"log_tail": tail(proc.stdout + proc.stderr)}),
            },
        )
    except subprocess.TimeoutExpired:
        ctx.state.item("matrix_table", {"status": "timeout", "rows": done})


PARTS = {
    "facts": part_facts,
    "strategies": part_strategies,
    "throughput": part_throughput,
    "matrix_compiled": lambda ctx: part_matrix(ctx, compiled=True),
    "matrix_eager": lambda ctx: part_matrix(ctx, compiled=False),
    "matrix_table": part_matrix_table,
}


# --------------------------------------------------------------------------------- model maker
def make_model(target: str, size: str) -> None:
    """Save a random-init Llama as safetensors with transformers (the 'saved HF model' a sharded load reads)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    shapes = {
        # ~323M parameters: 20 layers, hidden 1024, a 32k vocabulary (the GPU runs' tokenizer size)
        "300m": dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=20,
            num_attention_heads=16,
            num_key_value_heads=16,
            max_position_embeddings=2048,
            vocab_size=32000,
        ),
        "tiny": dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            vocab_size=2048,
        ),
    }[size]
    cfg = LlamaConfig(**shapes, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(target, safe_serialization=True)  # bf16 on disk, as published checkpoints are
    files = sum(p.stat().st_size for p in Path(target).glob("*.safetensors"))
    print(
        json.dumps(
            {
                "params": sum(p.numel() for p in model.parameters()),
                "size": size,
                "dtype_on_disk": "bf16",
                "safetensors_bytes": files,
                "shape": shapes,
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", default=str(REPO / "runs" / "gpu_suite"))
    parser.add_argument("--part", choices=sorted(PARTS) + ["fail"])
    parser.add_argument("--deadline", type=float, default=None, help="epoch seconds by which the part must be done")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--message", default="", help="with --part fail: what to record")
    parser.add_argument("--failed-part", default="")
    parser.add_argument("--report", nargs=2, metavar=("GPU_MD", "RESULTS_JSON"), help="write the report of --state and stop")
    parser.add_argument("--make-model", metavar="DIR")
    parser.add_argument("--size", default="300m", choices=("300m", "tiny"))
    args = parser.parse_args()
    if args.make_model:
        make_model(args.make_model, args.size)
        return 0
    if args.report:
        state = State(Path(args.state).resolve(), args.dry_run)
        gpu_report.write(state.data, Path(args.report[0]), Path(args.report[1]))
        return 0
    if args.part == "fail":  # gpu_suite.sh: a part that died or ran out of time as a whole (it could not say so itself)
        state = State(Path(args.state).resolve(), args.dry_run)
        if (state.data["parts"].get(args.failed_part) or {}).get("status") in (None, "running", "done"):
            state.part(args.failed_part, status="failed", reason=args.message)
        return 0
    signal.signal(signal.SIGTERM, _on_term)
    ctx = Ctx(args)
    t0 = time.time()
    ctx.state.part(args.part, status="running", started=time.strftime("%H:%M:%S"))
    try:
        PARTS[args.part](ctx)
        ctx.state.part(args.part, status="done", wall_s=round(time.time() - t0, 1))
    except Exception as exc:
        import traceback

        ctx.state.part(
            args.part,
            status="failed",
            wall_s=round(time.time() - t0, 1),
            reason=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc()[-3000:],
        )
        print(traceback.format_exc(), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
