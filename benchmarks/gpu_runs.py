"""The GPU suite's run machinery: its state file, its clock, launching one run with its device memory
sampled from outside, reading what the run wrote, and the rule that stops a part.

No harness module and no torch is imported here: the suite's own process must not hold a CUDA
context while it samples device memory, and it only reads the files the harness writes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RERUN = {"not reached"}  # the only status a later call runs again: the item was never started


# ---------------------------------------------------------------------------------------- state
class Clock:
    """The call's clock: real time, or (``--sim-clock``) a simulated one that moves only by what each
    step is estimated to take on the GPU, so a CPU rehearsal walks the real order against the real
    deadline in seconds."""

    def __init__(self, simulated: bool, start: float) -> None:
        self.simulated, self._t = simulated, start

    def now(self) -> float:
        return self._t if self.simulated else time.time()

    def spend(self, seconds: float) -> None:
        if self.simulated:
            self._t += seconds


class State:
    """``<state>/results.json``: {"meta", "parts": {name: {...}}, "items": {key: {...}}}, written
    atomically at every item, and mirrored at once into the call's out folder (results.json and the
    gpu.md report), so a call cut short still returns every number it finished."""

    def __init__(self, root: Path, dry: bool, out: Path | None = None, report: Any = None, clock: Clock | None = None) -> None:
        self.root, self.dry, self.out, self.report = root, dry, out, report
        self.clock = clock or Clock(False, time.time())
        self.path = root / "results.json"
        self.lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)
        self.fresh = not self.path.exists()
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"meta": {}, "parts": {}, "items": {}}
        self.data["meta"]["dry_run"] = dry

    def save(self) -> None:
        _write_atomic(self.path, json.dumps(self.data, indent=1, default=str))
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.path, self.out / "results.json.tmp")
            os.replace(self.out / "results.json.tmp", self.out / "results.json")
            if self.report is not None:
                try:  # a report bug must cost the report, never the numbers
                    self.report(self.data, self.out / "gpu.md")
                except Exception as exc:
                    print(f"[gpu_suite] gpu.md not written: {type(exc).__name__}: {exc}", flush=True)

    def item(self, key: str, value: dict[str, Any]) -> None:
        with self.lock:
            calls = len(self.data["meta"].get("calls", []))  # which call of this state folder recorded it
            value = dict(
                value, key=key, recorded_at=time.strftime("%Y-%m-%d %H:%M:%S"), call=calls, call_clock_s=round(self.clock.now(), 1)
            )
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

    def settled(self, key: str) -> bool:
        """An item an earlier call of this (still warm) machine started is not run again: the second
        call goes on where the first stopped; failures stay failures (GPU_SUITE_RETRY_FAILED=1 retries)."""
        prior = self.get(key)
        if prior is None or prior.get("status") in RERUN:
            return False
        if prior.get("status") != "ok" and os.environ.get("GPU_SUITE_RETRY_FAILED") == "1":
            return False
        print(f"[gpu_suite] {key}: {prior.get('status')} in an earlier call", flush=True)
        return True


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class FailureRule:
    """A part stops after two identical failures: the same error twice (a missing module, a kernel
    the image lacks) would fail every row after it too, and the call's minutes are better spent on
    the next part."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.stopped: str | None = None

    def note(self, item: dict[str, Any] | None) -> None:
        if not item or item.get("status") not in ("failed", "timeout"):
            return
        sig = failure_signature(item)
        self.seen[sig] += 1
        if self.seen[sig] >= 2:
            self.stopped = sig

    def reason(self) -> str:
        return f"part stopped after two identical failures: {self.stopped}"


def failure_signature(item: dict[str, Any]) -> str:
    """The line that says why a run failed: harness's one-line error, else the last exception line,
    else the exit status; digits folded so two runs' addresses and sizes do not tell them apart."""
    if item.get("status") == "timeout":
        return "timed out"
    lines = [ln.strip() for ln in str(item.get("log_tail") or "").splitlines() if ln.strip()]
    lines = [re.sub(r"^\[\s*[\d.]+\]\s*", "", ln) for ln in lines]  # launch()'s timestamps
    pick = next((ln for ln in reversed(lines) if ln.startswith("harness: error:")), None)
    pick = pick or next((ln for ln in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln)), None)
    pick = pick or str(item.get("reason") or f"exit {item.get('rc')}")
    return re.sub(r"\d+", "N", pick)[:200]


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
def write_config(path: Path, data: dict[str, Any]) -> None:
    """A run config as JSON (the harness reads YAML or JSON; this process does not need PyYAML)."""
    path.write_text(json.dumps(data, indent=1) + "\n")


ACTIVE_GROUPS: set[int] = set()  # process groups of the runs in flight, killed if this part is itself stopped


def on_term(signum: int, frame: Any) -> None:
    for pgid in list(ACTIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"[gpu_suite] stopped by signal {signum}; killed {len(ACTIVE_GROUPS)} run(s) in flight", flush=True)
    os._exit(124)


def launch(cmd: list[str], log: Path, timeout: float, env: dict[str, str], sampler_gpu: bool, cwd: Path = REPO) -> dict[str, Any]:
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


def finish_run(root: Path, res: dict[str, Any], out_dir: Path, warm: int, extra: dict[str, Any]) -> dict[str, Any]:
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
        log=str(res["log_path"].relative_to(root)),
    )
    if status != "ok":
        item["reason"] = ("timed out" if res["timed_out"] else f"exit {res['rc']}") + "; log tail in 'log_tail'"
        item["log_tail"] = tail(res["log_text"])
    return item
