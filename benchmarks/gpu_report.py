"""gpu.md from the GPU suite's results.json (one, or several merged: one per device-tool call).

    python benchmarks/gpu_report.py RESULTS.json [MORE.json ...] --out notes/gpu.md [--json merged.json]

Merging: items are keyed (e.g. "strategies/zero3/w1", "matrix/bf16", "plan/matrix/bf16"); for a
key present in several files an "ok" item beats a failed one, which beats a skipped one, and
among equals the later file wins. Every number comes from a run's files; a number the run did
not produce is printed as "-" with the reason, never estimated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gpu_long_seq import report_lines

GIB = 2**30
MIB = 2**20

# The Peak Memory study (shared/reference/004): 1.6B Llama-like, batch 4, one RTX 4090, 100 steps.
# Row name in experiments/peak_memory_gpu.yaml -> (peak GiB, reduction vs control, samples/s).
STUDY_4090 = {
    "control fp32": (21.165, None, 2.518),
    "bf16": (12.418, 0.413, 6.79),
    "AC": (12.529, 0.408, 2.03),
    "compile": (19.712, 0.069, 2.307),
    "optimizer-in-backward": (21.164, 0.0, 2.535),
    "OIB + AC": (7.425, 0.649, 2.049),
    "bf16 + OIB + AC": (3.975, 0.812, 5.834),
    "budget 0.05": (13.561, 0.359, 1.574),
    "budget 0.60": (15.636, 0.261, 1.760),
    "OIB + budget 0.05": (13.562, 0.359, 1.938),
    "bf16 + budget 0.60": (6.709, 0.683, 2.76),
}
STRATEGY_ORDER = ["ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp_grad_op", "fsdp_offload", "zero2_offload", "zero3_offload"]
RANK_ORDER = {"ok": 3, "timeout": 2, "failed": 2, "running": 1, "simulated": 1, "skipped": 0, "not reached": 0}


def merge(datas: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"meta": {}, "parts": {}, "items": {}}
    for data in datas:
        for k, v in (data.get("meta") or {}).items():
            if v or k not in out["meta"]:
                out["meta"][k] = v
        for name, part in (data.get("parts") or {}).items():
            out["parts"].setdefault(name, {}).update(part)
        for key, item in (data.get("items") or {}).items():
            old = out["items"].get(key)
            if old is None or RANK_ORDER.get(item.get("status"), 0) >= RANK_ORDER.get(old.get("status"), 0):
                out["items"][key] = item
    return out


def gib(b: Any) -> str:
    """GiB with 2 decimals; below 0.1 GiB (tiny dry-run models) MiB, marked, so nothing prints as 0.00."""
    if not isinstance(b, (int, float)):
        return "-"
    return f"{b / GIB:.2f}" if abs(b) >= 0.1 * GIB else f"{b / MIB:.1f} MiB"


def mib(b: Any) -> str:
    return "-" if not isinstance(b, (int, float)) else f"{b / MIB:,.1f}"


def num(x: Any, fmt: str = "{:,.0f}") -> str:
    return "-" if not isinstance(x, (int, float)) else fmt.format(x)


def pct(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.1%}"


def status_note(item: dict[str, Any] | None) -> str:
    if item is None:
        return "not run"
    s = item.get("status", "?")
    reason = item.get("reason")
    return s if s == "ok" or not reason else f"{s}: {reason}"


def items_under(data: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    return {k[len(prefix) :]: v for k, v in data["items"].items() if k.startswith(prefix)}


def host_gib(meminfo: Any) -> str:
    """/proc/meminfo's 'NNN kB' as GiB."""
    try:
        return f"{int(str(meminfo).split()[0]) * 1024 / GIB:.0f} GiB"
    except (ValueError, IndexError):
        return str(meminfo)


def device_line(data: dict[str, Any]) -> list[str]:
    facts = data["items"].get("facts") or data["meta"].get("device") or {}
    if not facts:
        return ["Device facts were not recorded."]
    lines = []
    if facts.get("gpu_name"):
        lines.append(
            f"- Device: **{facts.get('gpu_name')}** x {facts.get('gpus')} ({facts.get('gpu_memory_mib')} MiB each); "
            f"{facts.get('cpu_count')} CPU cores, host memory {host_gib(facts.get('host_memory'))}."
        )
    else:
        lines.append(
            f"- Device: **no GPU** (dry run on CPU: {facts.get('cpu_count')} cores, host memory {host_gib(facts.get('host_memory'))})."
        )
    lines.append(
        f"- torch {facts.get('torch')} (CUDA {facts.get('cuda')}), DeepSpeed {facts.get('deepspeed')}, transformers "
        f"{facts.get('transformers')}, accelerate {facts.get('accelerate')}, Python {facts.get('python_version')}."
    )
    if facts.get("capability"):
        lines.append(
            f"- Compute capability {facts.get('capability')}, {facts.get('sms')} SMs, bf16 {facts.get('bf16')}, "
            f"NCCL {facts.get('nccl')}, cuDNN {facts.get('cudnn')}."
        )
    if facts.get("nvidia_smi_query"):
        lines += ["", "```", str(facts["nvidia_smi_query"]), "```"]
    setup = facts.get("setup")
    if setup:
        lines.append(f"- Setup: {setup.get('summary', json.dumps(setup))}")
    cab = data["items"].get("setup/cpu_adam_build")
    if cab:
        lines.append(f"- DeepSpeed CPU Adam JIT build: {status_note(cab)}")
    return lines


def strategy_table(data: dict[str, Any]) -> list[str]:
    items = items_under(data, "strategies/")
    if not items:
        return ["Not run."]
    sm = data["items"].get("saved_model") or {}
    first = next(iter(items.values()))
    cfg = first.get("config") or {}
    lines = [
        f"Model: {num(sm.get('params'))} parameters saved as {sm.get('dtype_on_disk', '?')} safetensors and loaded from disk "
        f"({sm.get('path', cfg.get('model', {}).get('name'))}); {cfg.get('precision')}, seq {cfg.get('data', {}).get('seq_len')}, "
        f"micro-batch {cfg.get('micro_batch_size')}, {cfg.get('steps')} steps, embedded corpus. Bytes per rank from "
        "`state_bytes/rank0.json` (storages held in step 0); max allocated = max over steps of `memory/max_allocated_bytes` "
        "(reset every step); load peak = device memory in use (outside sampler) from process start until the engine was "
        "built; tokens/s = median after 2 warm-up steps.",
        "",
        "| strategy | ranks | params MiB | master MiB | grads MiB | optim MiB | max allocated GiB | max reserved GiB | "
        "load-phase device peak GiB | run device peak GiB | tokens/s | final loss | eval loss | CPU Adam | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]

    def order(key: str) -> tuple[int, int]:
        name, _, world = key.partition("/w")
        return (int(world or 1), STRATEGY_ORDER.index(name) if name in STRATEGY_ORDER else 99)

    for key in sorted(items, key=order):
        it = items[key]
        name, _, world = key.partition("/w")
        m = it.get("metrics") or {}
        sb = (it.get("state_bytes") or {}).get("rank0") or {}
        mem = it.get("device_memory") or {}
        lines.append(
            f"| {name} | {world} | {mib(sb.get('params'))} | {mib(sb.get('master_params'))} | {mib(sb.get('grads'))} | "
            f"{mib(sb.get('optim_state'))} | {gib(m.get('max_allocated_bytes'))} | {gib(m.get('max_reserved_bytes'))} | "
            f"{gib(mem.get('load_peak_bytes'))} | {gib(mem.get('run_peak_bytes'))} | {num(m.get('tokens_per_s'))} | "
            f"{num(m.get('final_loss'), '{:.4f}')} | {num(m.get('eval_loss'), '{:.4f}')} | {it.get('cpu_adam') or ''} | "
            f"{status_note(it)} |"
        )
    src = next((it.get("device_memory", {}).get("source") for it in items.values() if it.get("device_memory", {}).get("source")), None)
    if src:
        lines += ["", f"Device peaks sampled from outside: {src}."]
    return lines


def throughput_table(data: dict[str, Any]) -> list[str]:
    items = items_under(data, "throughput/")
    if not items:
        return ["Not run."]
    cfg = next(iter(items.values())).get("config") or {}
    lines = [
        f"Model {cfg.get('model', {}).get('name')}, bf16, one process (`strategy=ddp`, world 1), seq "
        f"{cfg.get('data', {}).get('seq_len')}, {cfg.get('steps')} steps; medians exclude the first warm-up steps "
        "(compile, the memory split on steps 0-1). MFU is the harness's `perf/mfu` (6N + 12·L·H·d·S FLOPs per token over "
        "the device's dense bf16 peak).",
        "",
        "| configuration | micro-batch | tokens/s | tokens/s/device | step time s | MFU | peak FLOP/s used | max allocated GiB | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    best = None
    for name, it in items.items():
        m = it.get("metrics") or {}
        c = it.get("config") or {}
        lines.append(
            f"| {name} | {c.get('micro_batch_size')} | {num(m.get('tokens_per_s'))} | {num(m.get('tokens_per_s_per_device'))} | "
            f"{num(m.get('step_time_s'), '{:.3f}')} | {pct(m.get('mfu'))} | {num(m.get('peak_flops_per_device'), '{:.3g}')} | "
            f"{gib(m.get('max_allocated_bytes'))} | {status_note(it)} |"
        )
        if it.get("status") == "ok" and isinstance(m.get("mfu"), (int, float)) and (best is None or m["mfu"] > best[1]):
            best = (name, m["mfu"], m.get("tokens_per_s"))
    facts = data["items"].get("facts") or {}
    if best:
        target = "met" if best[1] >= 0.40 else "NOT met"
        lines += [
            "",
            f"Best: **{best[0]}**, {num(best[2])} tokens/s, MFU **{best[1]:.1%}** "
            f"(target >= 40% on an H100: {target}; device {facts.get('gpu_name')}).",
        ]
    else:
        lines += ["", "No run produced an MFU (on CPU there is no peak-FLOPs table: expected in a dry run)."]
    return lines


def matrix_table(data: dict[str, Any]) -> list[str]:
    items = items_under(data, "matrix/")
    if not items:
        return ["Not run."]
    ctrl = items.get("control fp32", {})
    ctrl_peak = (ctrl.get("experiments_row") or {}).get("peak_bytes")
    sets = next((it.get("matrix_set") for it in items.values() if it.get("matrix_set")), [])
    lines = [
        f"`python -m harness.experiments experiments/peak_memory_gpu.yaml --only ROW --set {' '.join(sets)}`, one row per "
        "process. Peak = the harness's row peak (`torch.cuda.max_memory_allocated` on a GPU); samples/s = median after 2 "
        "warm-up steps. The study ran 100 steps on an RTX 4090 (its samples/s include compile time).",
        "",
        "| configuration | peak GiB | reduction vs control | samples/s | eval ppl | study 4090 peak GiB | study reduction | "
        "study samples/s | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = list(STUDY_4090) + [k for k in items if k not in STUDY_4090]
    for name in order:
        if name not in items:
            continue
        it = items[name]
        row = it.get("experiments_row") or {}
        peak = row.get("peak_bytes")
        red = 1 - peak / ctrl_peak if isinstance(peak, (int, float)) and ctrl_peak else None
        study = STUDY_4090.get(name)
        lines.append(
            f"| {name} | {gib(peak)} | {pct(red) if name != 'control fp32' else '-'} | "
            f"{num(row.get('samples_per_s'), '{:.2f}')} | "
            f"{num(row.get('eval_perplexity'), '{:.1f}')} | {study[0] if study else '-'} | "
            f"{pct(study[1]) if study and study[1] is not None else '-'} | {study[2] if study else '-'} | {status_note(it)} |"
        )
    sources = {(it.get("experiments_row") or {}).get("peak_source") for it in items.values()} - {None}
    if sources:
        lines += ["", "Peak source(s): " + ", ".join(sorted(sources)) + "."]
    return lines


def planner_table(data: dict[str, Any]) -> list[str]:
    plans = items_under(data, "plan/")
    if not plans:
        return ["No plan was run."]
    lines = [
        "`python -m harness.plan --config <the run's config> --gpus W --gpu-mem <device MiB> --json` for each measured run. "
        "Predicted = `peak_bytes` (the planner's prediction of max_memory_allocated); measured = max over steps of "
        "`memory/max_allocated_bytes`. Stated allowance = the planner's context + NCCL + workspaces + fragmentation; "
        "observed overhead = run-phase device memory in use (outside sampler, minus the idle baseline) - measured max allocated.",
        "",
        "| run | predicted GiB | measured GiB | measured by | error | stated allowance GiB | observed overhead GiB | "
        "predicted need GiB | observed device peak GiB | plan status |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    errors = []
    for key, plan in sorted(plans.items()):
        run = data["items"].get(key) or {}
        m = run.get("metrics") or {}
        measured, source = m.get("max_allocated_bytes"), "max_memory_allocated"
        row = run.get("experiments_row") or {}
        if measured is None and row.get("peak_source") == "max_memory_allocated":
            measured = row.get("peak_bytes")
        if measured is None and m.get("tracked_total_peak_bytes"):  # CPU (dry run): MemTracker, not a GPU number
            measured, source = m["tracked_total_peak_bytes"], "MemTracker (CPU)"
        if measured is None:
            source = "-"
        pred = plan.get("peak_bytes")
        err = (pred - measured) / measured if isinstance(pred, (int, float)) and isinstance(measured, (int, float)) and measured else None
        if err is not None:
            errors.append(abs(err))
        allow = (plan.get("allowance_bytes") or {}).get("total")
        mem = run.get("device_memory") or {}
        peak, base = mem.get("run_peak_bytes"), mem.get("baseline_bytes") or 0
        observed = peak - base if isinstance(peak, (int, float)) else None
        overhead = (
            observed - measured
            if isinstance(observed, (int, float)) and isinstance(measured, (int, float)) and source == "max_memory_allocated"
            else None
        )
        lines.append(
            f"| {key} | {gib(pred)} | {gib(measured)} | {source} | {pct(err) if err is not None else '-'} | "
            f"{gib(allow)} | {gib(overhead)} | "
            f"{gib(plan.get('device_need_bytes'))} | {gib(observed)} | {status_note(plan)} |"
        )
    if errors:
        errors.sort()
        lines += ["", f"{len(errors)} configs compared: median |error| {errors[len(errors) // 2]:.1%}, max {errors[-1]:.1%}."]
    return lines


def offload_section(data: dict[str, Any]) -> list[str]:
    lines = []
    for s in ("fsdp_offload", "zero2_offload", "zero3_offload"):
        for key, it in sorted(items_under(data, f"strategies/{s}/").items()):
            m = it.get("metrics") or {}
            lines.append(
                f"- `{s}` world {key.lstrip('w')}: {status_note(it)}; max allocated {gib(m.get('max_allocated_bytes'))} GiB, "
                f"{num(m.get('tokens_per_s'))} tokens/s, final loss {num(m.get('final_loss'), '{:.4f}')}"
                + (f"; optimizer: {it['cpu_adam']}" if it.get("cpu_adam") else "")
            )
    return lines or ["Not run."]


def load_section(data: dict[str, Any]) -> list[str]:
    lines = [
        "The harness resets the allocator's peak at every step and logs no load-phase number, so the load phase is measured "
        "from outside: device memory in use (all processes, CUDA context and allocator cache included) from process start "
        "until the metrics `start` record (written once the engine is built), minus the idle baseline. A true "
        "`max_memory_allocated` for the load phase needs harness support (see notes/gpu_plan.md).",
        "",
    ]
    for s in ("fsdp", "zero3"):
        for key, it in sorted(items_under(data, f"strategies/{s}/").items()):
            mem = it.get("device_memory") or {}
            base = mem.get("baseline_bytes") or 0
            lp = mem.get("load_peak_bytes")
            lines.append(
                f"- `{s}` world {key.lstrip('w')} loading the saved model: load-phase device peak "
                f"{gib(lp - base if isinstance(lp, (int, float)) else None)} GiB above an idle baseline of {gib(base)} GiB "
                f"(boundary: {mem.get('load_boundary', '-')}); {status_note(it)}"
            )
    return lines


def failures(data: dict[str, Any]) -> list[str]:
    lines = []
    for name, part in data["parts"].items():
        if part.get("status") not in ("done", None):
            lines.append(f"- part `{name}`: {part.get('status')} {part.get('reason', '')}".rstrip())
    for key, it in sorted(data["items"].items()):
        if it.get("status") not in ("ok", None):
            lines.append(f"- `{key}`: {status_note(it)}")
    return lines or ["None."]


def timing_table(data: dict[str, Any]) -> list[str]:
    """Each run's wall time beside the estimate the call was planned with (gpu_parts.ESTIMATE_S):
    the numbers the next plan's estimates come from."""
    rows = [(k, it) for k, it in data["items"].items() if it.get("estimate_s") is not None]
    if not rows:
        return ["No run recorded an estimate."]
    lines = ["| run | call | status | wall s | estimate s |", "|---|---:|---|---:|---:|"]
    for key, it in rows:
        lines.append(f"| {key} | {it.get('call', '-')} | {it.get('status')} | {num(it.get('wall_s'), '{:.1f}')} | {it['estimate_s']} |")
    return lines


def build(data: dict[str, Any]) -> str:
    dry = data["meta"].get("dry_run")
    facts = data["items"].get("facts") or {}
    title = f"# GPU measurements: {facts.get('gpu_name') or 'no GPU'}" + (" (DRY RUN on CPU: plumbing only, no GPU numbers)" if dry else "")
    if data["meta"].get("simulated_clock"):
        title += " (REHEARSAL: nothing trained; each run spent its GPU estimate on a simulated clock)"
    parts = [
        title,
        "",
        "Written by `benchmarks/gpu_suite.sh`; see notes/gpu_plan.md for how it was run.",
        "",
        "## Device",
        "",
        *device_line(data),
        "",
        "## Strategies on the GPU (notes/core.md's table)",
        "",
        *strategy_table(data),
        "",
        "## llama-1.6b bf16 throughput and MFU",
        "",
        *throughput_table(data),
        "",
        "## Peak-memory matrix (s004) next to the study's RTX 4090",
        "",
        *matrix_table(data),
        "",
        "## Planner vs torch.cuda.max_memory_allocated",
        "",
        *planner_table(data),
        "",
        "## The longest sequence: planner vs GPU",
        "",
        *report_lines(data["items"].get("long_seq")),
        "",
        "## Offload actually run on the GPU",
        "",
        *offload_section(data),
        "",
        "## Load phase of a sharded load",
        "",
        *load_section(data),
        "",
        "## Time per run against the plan's estimate",
        "",
        *timing_table(data),
        "",
        "## Failures, timeouts and skips",
        "",
        *failures(data),
        "",
    ]
    mt = data["items"].get("matrix_table") or {}
    if mt.get("results_md"):
        parts += ["## harness.experiments' own table (rows finished in one state folder)", "", mt["results_md"]]
    return "\n".join(parts)


def write(data: dict[str, Any], md: Path, js: Path | None) -> None:
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(build(data))
    if js is not None:
        js.write_text(json.dumps(data, indent=1, default=str))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", required=True, help="markdown to write (e.g. notes/gpu.md)")
    parser.add_argument("--json", default=None, help="also write the merged results here")
    args = parser.parse_args()
    data = merge([json.loads(Path(p).read_text()) for p in args.results])
    write(data, Path(args.out), Path(args.json) if args.json else None)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
