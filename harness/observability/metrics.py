"""Metric names, value cleaning, interval aggregation and the JSON-lines metrics file.

The names live here, in one place, because three consumers must agree on them: the W&B
dashboard (whose sections are the prefix before the first `/`), the JSON-lines file that
scripts and the plots read, and the trainer that produces the numbers. Sections:

- `train/`  loss, lr, grad_norm, skipped_steps (cumulative count of skipped steps)
- `perf/`   tokens_per_s, samples_per_s (global), *_per_device, mfu, step_time_s
- `memory/` `<category>_peak_bytes` per category (sampled steps), max_allocated_bytes, max_reserved_bytes (GPU),
  max_rss_bytes (CPU), every step
- `eval/`   loss, perplexity
- `moe/`    expert_load/layer_<i>: a mixture-of-experts layer's most loaded expert over the mean tokens per
  expert, per step (with `train/aux_loss`, the router's load-balancing loss: `harness.training.router`)
- `prune/`  sparsity/<layer>, achieved_sparsity

The metrics file is append-safe JSON lines (one object per event, flushed per line) so a
run that dies still leaves everything it logged up to the crash, and `jq`/pandas read it
without a custom parser. Non-finite numbers are written as `null`, because NaN/Infinity
are not JSON and strict readers reject them.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any, TextIO

import torch

from harness.memory import COUNTER_KEYS, REPORTED
from harness.training import AUX_LOSS, EXPERT_LOAD

# The W&B x-axis: every event carries it, so eval and prune points line up with training.
STEP = "train/step"

TRAIN_LOSS = "train/loss"
TRAIN_LR = "train/lr"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_SKIPPED = "train/skipped_steps"
TRAIN_AUX_LOSS = AUX_LOSS  # the router's load-balancing loss, without its coefficient (named where it is made)
EXPERT_LOAD_PREFIX = EXPERT_LOAD  # + a layer's index: max/mean tokens per expert over the step

TOKENS_PER_S = "perf/tokens_per_s"
SAMPLES_PER_S = "perf/samples_per_s"
TOKENS_PER_S_DEVICE = "perf/tokens_per_s_per_device"
SAMPLES_PER_S_DEVICE = "perf/samples_per_s_per_device"
MFU = "perf/mfu"
STEP_TIME = "perf/step_time_s"

MEMORY_CATEGORIES = REPORTED  # the panels; buffers and 'other' appear when a run logs them
MAX_ALLOCATED = "memory/max_allocated_bytes"
MAX_RESERVED = "memory/max_reserved_bytes"
MAX_RSS = "memory/max_rss_bytes"  # CPU: the process's resident high-water mark over the step
MEMORY_TOTAL = "memory/total_peak_bytes"  # optional: the tracker's whole-process peak

EVAL_LOSS = "eval/loss"
EVAL_PERPLEXITY = "eval/perplexity"

PRUNE_ACHIEVED = "prune/achieved_sparsity"
PRUNE_LAYER_PREFIX = "prune/sparsity/"

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"  # records of a timeline a resume abandoned

# Names harness.memory.StepMemoryTracker's per-step peaks take when the trainer prefixes them as
# `memory/<key>_peak_bytes`: the allocator peaks are the GPU truth, not categories.
ALIASES = {
    "memory/device_allocated_peak_bytes": MAX_ALLOCATED,
    "memory/device_reserved_peak_bytes": MAX_RESERVED,
    "memory/host_rss_peak_bytes": MAX_RSS,
}
_NOT_CATEGORIES = frozenset({"total", *COUNTER_KEYS})

_CATEGORY_RE = re.compile(r"^memory/(.+)_peak_bytes$")

# Within one log interval these keep the last value (a schedule or a running count);
# memory keeps the maximum (a peak must survive subsampling); everything else is averaged.
PEAK_RANK = "memory/peak_rank"  # the rank whose step peaked highest (the memory panels show that rank)
_LAST_KEYS = frozenset({TRAIN_LR, TRAIN_SKIPPED, PEAK_RANK})


def memory_key(category: str) -> str:
    """`memory/<category>_peak_bytes`, the per-category peak the memory panel stacks."""
    return f"memory/{category}_peak_bytes"


def memory_categories(keys: Any) -> list[str]:
    """Categories present among `keys`, the canonical six first, in their canonical order."""
    found = {m.group(1) for k in keys if (m := _CATEGORY_RE.match(k)) and m.group(1) not in _NOT_CATEGORIES}
    known = [c for c in MEMORY_CATEGORIES if c in found]
    return known + sorted(found - set(known))


def expert_loads(record: dict[str, Any]) -> dict[int, float]:
    """A record's expert load per layer index (`moe/expert_load/layer_<i>`), in layer order."""
    found = {int(k[len(EXPERT_LOAD_PREFIX) :]): v for k, v in record.items() if k.startswith(EXPERT_LOAD_PREFIX)}
    return {i: found[i] for i in sorted(found) if isinstance(found[i], (int, float))}


def as_number(value: Any) -> int | float | None:
    """An int or float from a Python/NumPy/torch scalar; None if it is not a number.

    Ints stay ints (byte counts are exact); 0-dim tensors and NumPy scalars become floats
    through `float()`, which is what they define for that purpose.
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (str, bytes, dict, list, tuple)) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def deferred(value: Any) -> bool:
    """A one-element floating tensor (a device's gradient norm): kept unread until its interval is
    written, so a step between log steps does not wait for the device to read it."""
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def with_section(metrics: dict[str, Any], section: str) -> dict[str, Any]:
    """Prefix bare names with `section/` so `{"loss": x}` from log_eval lands in `eval/loss`;
    map `ALIASES` to their canonical names."""
    out = {}
    for key, value in metrics.items():
        key = key if "/" in key else f"{section}/{key}"
        out[ALIASES.get(key, key)] = value
    return out


def flatten(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to `a/b/c` keys: `{"sparsity": {"layers.0.q": 0.5}}` -> `sparsity/layers.0.q`."""
    out: dict[str, Any] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        else:
            out[name] = value
    return out


def prune_entries(stats: Any) -> dict[str, Any]:
    """`prune/...` entries from a pruning report: a `PruneReport` (anything with `to_dict()`),
    its dict with `layers: [{"name", "sparsity", ...}]`, or a nested/flat dict of numbers.

    Per-layer sparsity always ends up as `prune/sparsity/<layer>`; None values are dropped.
    """
    if hasattr(stats, "to_dict"):
        stats = stats.to_dict()
    stats = dict(stats)
    layers = stats.pop("layers", None)
    if isinstance(layers, list):
        per_layer = {x["name"]: x["sparsity"] for x in layers if isinstance(x, dict) and "name" in x and "sparsity" in x}
        stats["sparsity"] = {**per_layer, **(stats.get("sparsity") or {})}
    flat = flatten(stats)
    return {(k if k.startswith("prune/") else f"prune/{k}"): v for k, v in flat.items() if v is not None}


def json_safe(value: Any) -> Any:
    """Non-finite floats to None (strict JSON); everything else unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


class IntervalAggregator:
    """Folds the steps between two logged steps into one record (see `_LAST_KEYS`)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._values: dict[str, int | float] = {}

    def __bool__(self) -> bool:
        return bool(self._values)

    def add(self, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if key in _LAST_KEYS:
                self._values[key] = value
            elif key.startswith("memory/"):
                old = self._values.get(key)
                self._values[key] = value if old is None else max(old, value)
            else:
                value = value.double() if deferred(value) else value  # summed as the host sums floats
                self._sums[key] = self._sums.get(key, 0.0) + value
                self._counts[key] = self._counts.get(key, 0) + 1
                self._values[key] = value

    def pop(self) -> dict[str, int | float]:
        """The interval's record; deferred values (`deferred`) are summed on their device and read here, once."""
        out = dict(self._values)
        for key, total in self._sums.items():
            n = self._counts[key]
            out[key] = out[key] if n == 1 else total / n
        self._sums.clear()
        self._counts.clear()
        self._values.clear()
        return {k: as_number(v) if deferred(v) else v for k, v in out.items()}


class MetricsWriter:
    """`<run_dir>/metrics.jsonl`: one `{"kind", "step", "time", <metric>: value}` per event."""

    def __init__(self, run_dir: str, append: bool = False, resumed_at: int | None = None) -> None:
        """`append`: continue the file (a resumed run); `resumed_at`: the step the run resumes
        from: the records after it belong to an abandoned timeline and move to
        `metrics.superseded.jsonl`, so each step appears once here and nothing is lost. Not
        `append`: an earlier run's records move there whole (never truncated away)."""
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)
        if os.path.isfile(self.path) and (resumed_at is not None or not append):
            # A fresh run in a directory with an earlier run's metrics keeps them too: all move aside (step -1: none kept).
            _set_aside_after(self.path, resumed_at if append and resumed_at is not None else -1, os.path.join(run_dir, SUPERSEDED_FILE))
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")

    def write(self, kind: str, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"kind": kind, "step": int(step), "time": time.time()}
        record.update({k: json_safe(v) for k, v in metrics.items()})
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False, default=str) + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _set_aside_after(path: str, step: int, superseded: str) -> None:
    """Keep the records up to `step` in `path` (rewritten atomically); append the later ones
    (and a torn last line) to `superseded`."""
    keep, later = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                later.append(line if line.endswith("\n") else line + "\n")
                continue
            (keep if int(record.get("step", 0)) <= step and record.get("kind") != "summary" else later).append(line)
    if not later:
        return
    with open(superseded, "a", encoding="utf-8") as f:
        f.writelines(later)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def read_records(path: str) -> list[dict[str, Any]]:
    """The events of a metrics file, the last one kept where a step was logged twice.

    A resumed run appends to the file and re-logs the steps after its checkpoint; keeping
    the last record per (kind, step) makes the plots and summary show the run that survived.
    A torn last line (a crash mid-write) is skipped.
    """
    if not os.path.isfile(path):
        return []
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            latest.pop((record.get("kind"), record.get("step")), None)
            latest[(record.get("kind"), record.get("step"))] = record
    return sorted(latest.values(), key=lambda r: (r.get("step", 0), r.get("time", 0.0)))
