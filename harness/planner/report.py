"""What the planner prints: per-rank peak by category, when it happens, what a CPU trace cannot see.

Four parts, each stated as what it is:

1. the traced + modelled per-rank peak by category and the moment it happens
   (forward/backward op, gradient reduction or optimizer step), and the host memory
   per rank and per node (offload, and the full fp32 model the trainer builds on the host);
2. an explicit GPU allowance for what no CPU trace sees: CUDA context, NCCL buffers,
   cuBLAS workspaces, caching-allocator fragmentation. These are stated assumptions,
   added to the prediction only for the fits / does-not-fit verdict;
3. for a mixture of experts, the routing: the peak in the worst case and the balanced one, which
   the verdict uses (``harness.planner.moe``);
4. the per-dtype model-state table (fp32 / bf16 with fp32 Adam / bf16
   with bf16 Adam) for the whole model on one GPU, with the shortfall against the GPU
   memory given - the quick "is this even close" view.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.planner.model_states import dtype_breakdown
from harness.planner.moe import ROUTINGS
from harness.planner.result import REPORT_CATS, Estimate
from harness.planner.trace import PlanError

GIB = 1024**3
MIB = 1024**2
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": MIB,
    "mib": MIB,
    "mb": 1000**2,
    "g": GIB,
    "gib": GIB,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}

# What a CPU trace cannot see on a GPU (assumptions, stated in every report).
CUDA_CONTEXT = 600 * MIB  # driver context + torch kernels loaded lazily, per process
NCCL_BUFFERS = 512 * MIB  # communicator buffers when world > 1 (NCCL_BUFFSIZE x channels x peers)
LIBRARY_WORKSPACES = 64 * MIB  # cuBLAS (32 MiB per handle on Hopper) and cuDNN workspaces
FRAGMENTATION = 0.10  # caching allocator: reserved exceeds allocated by ~5-15% at the peak


def parse_size(text: str) -> int:
    """'48GiB', '80GB', '512G', '1.5TiB', '12345' -> bytes; anything else is a one-line error."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise PlanError(f"unknown memory size '{text}': use a number with a unit like 48GiB, 80GB, 512G or 1.5TiB")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise PlanError(f"memory size '{text}' must be positive")
    return int(value)


def gib(n: float) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below (a tiny model's peak is a few MiB)."""
    return f"{n / GIB:,.2f} GiB" if abs(n) >= GIB else f"{n / MIB:,.2f} MiB"


@dataclass
class Allowance:
    context: int
    nccl: int
    workspaces: int
    fragmentation: int

    @property
    def total(self) -> int:
        return self.context + self.nccl + self.workspaces + self.fragmentation


def gpu_allowance(est: Estimate) -> Allowance:
    """The stated allowance for a GPU target; nothing for a CPU run (the trace is the truth there)."""
    if est.target != "cuda":
        return Allowance(0, 0, 0, 0)
    return Allowance(CUDA_CONTEXT, NCCL_BUFFERS if est.world_size > 1 else 0, LIBRARY_WORKSPACES, int(FRAGMENTATION * est.total))


@dataclass
class Verdict:
    fits: bool
    device_need: int
    host_need_per_node: int | None
    reason: str


def verdict(est: Estimate, gpu_mem: int, cpu_mem: int | None, gpus_per_node: int) -> Verdict:
    """Fits when peak + allowance fits one GPU and the node's host memory holds every rank's host share.

    On a CPU run there is one memory: ``gpu_mem`` is read as the budget per rank, the peak
    already includes offloaded state, and a node holds ``gpus_per_node`` such peaks.
    """
    allowance = gpu_allowance(est).total
    need = est.total + allowance
    unit = "per GPU" if est.target == "cuda" else "per rank"
    if est.target == "cuda":
        load_need = est.load_device + allowance
        host_node = max(est.host_peak, est.load_host) * gpus_per_node
    else:  # one memory: what loading holds on "device" and host together
        load_need = est.load_device + est.load_host
        host_node = max(est.total, load_need) * gpus_per_node
    if load_need > gpu_mem:
        return Verdict(
            False, load_need, host_node, f"loading the model needs {gib(load_need)} {unit} > {gib(gpu_mem)} (before the first step)"
        )
    if need > gpu_mem:
        return Verdict(False, need, host_node, f"needs {gib(need)} {unit} > {gib(gpu_mem)}")
    if cpu_mem is not None and host_node > cpu_mem:
        return Verdict(False, need, host_node, f"needs {gib(host_node)} host memory per node > {gib(cpu_mem)}")
    return Verdict(True, need, host_node, f"fits: {gib(need)} of {gib(gpu_mem)} {unit}")


def format_estimate(est: Estimate, gpu_mem: int, cpu_mem: int | None, gpus_per_node: int, title: str) -> str:
    """The full text report of one planned config."""
    allow = gpu_allowance(est)
    v = verdict(est, gpu_mem, cpu_mem, gpus_per_node)
    lines = [title, ""]
    lines.append(f"Per-rank peak (worst rank {est.rank} of {est.world_size}, engine {est.engine}): {gib(est.total)}")
    lines.append(f"  when: {est.peak.name}")
    state = est.peak.categories.get("optimizer_state", 0)
    if state and "optimizer" not in est.peak.name:
        # torch's optimizers create their state inside their first step (DeepSpeed's exists from the start)
        lines.append(
            f"  a step from the second on: under DDP/FSDP2 the first step holds no optimizer state before its "
            f"optimizer step, so its peak here reads up to {gib(state)} lower"
        )
    where = ("on the GPU", "on the host") if est.target == "cuda" else ("as device memory", "as host memory")
    lines.append(
        f"  loading the model (before the first step): {gib(est.load_device)} {where[0]}, {gib(est.load_host)} {where[1]} "
        "(this rank's part of the weights and one tensor in flight)"
    )
    width = max(len(c) for c in REPORT_CATS)
    for cat in REPORT_CATS:
        value = est.peak.categories.get(cat, 0)
        share = 100.0 * value / est.total if est.total else 0.0
        lines.append(f"    {cat.replace('_', ' '):<{width}}  {gib(value):>14}  {share:5.1f}%")
    lines.append("  moments of the step:")
    for m in est.moments:
        lines.append(f"    {m.name:<60.60}  {gib(m.total):>14}")
    lines.extend(format_routing(est))
    lines.extend(format_traffic(est))
    if est.target == "cuda":
        lines.append("")
        lines.append("Allowance for what a CPU trace cannot see on a GPU (assumed, not traced):")
        lines.append(f"    CUDA context                        {gib(allow.context):>14}")
        lines.append(f"    NCCL communicator buffers           {gib(allow.nccl):>14}")
        lines.append(f"    cuBLAS/cuDNN workspaces             {gib(allow.workspaces):>14}")
        lines.append(f"    allocator fragmentation ({FRAGMENTATION:.0%} of peak) {gib(allow.fragmentation):>14}")
        lines.append(f"  predicted max_memory_allocated {gib(est.total)} + allowance {gib(allow.total)} = {gib(est.total + allow.total)}")
    lines.append("")
    lines.append("Host (CPU) memory:")
    if est.target == "cpu":
        lines.append("    a CPU run: host and device are one memory; offloaded state is in the peak above")
    if est.host:
        for key, value in est.host.items():
            lines.append(f"    {key.replace('_', ' '):<28}  {gib(value):>14} per rank")
        lines.append(f"    step peak (incl. optimizer temporaries) {gib(est.host_peak)} per rank")
    else:
        lines.append("    no offload: model state stays on the GPU")
    lines.append(f"    loading the model (one tensor in flight; offloaded parameters) {gib(est.load_host)} per rank")
    lines.append(f"    per node ({gpus_per_node} ranks): {gib(v.host_need_per_node or 0)}" + (f" of {gib(cpu_mem)}" if cpu_mem else ""))
    lines.append("")
    split = est.routing is not None and est.routing.expert > 1
    lines.append(format_dtype_table(est.params_total, gpu_mem, "this rank's" if split else "all"))
    lines.append("")
    lines.append(("FITS" if v.fits else "DOES NOT FIT") + f": {v.reason.removeprefix('fits: ')}")
    for note in est.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def format_traffic(est: Estimate) -> list[str]:
    """What this rank sends per step, by collective (`harness.distributed.traffic`'s volumes)."""
    if est.world_size == 1:
        return []
    if est.traffic is None:
        return ["", "Traffic: not planned for DeepSpeed's engine"]
    parts = ", ".join(f"{kind.replace('_', '-')} {gib(n)}" for kind, n in sorted(est.traffic.items(), key=lambda kv: -kv[1]))
    return [
        "",
        f"Traffic of rank {est.rank}, a step's forwards and backwards: {gib(sum(est.traffic.values()))} sent ({parts or 'nothing'}); "
        "volumes as NCCL's tests count bus bytes, the optimizer step's norm not included",
    ]


def format_routing(est: Estimate) -> list[str]:
    """A mixture of experts' routing cases and which one the verdict uses; nothing for a dense model."""
    r = est.routing
    if r is None:
        return []
    f = r.facts
    lines = [
        "",
        f"Routing ({f.layers} MoE layers x {f.experts} experts, top-{f.top_k}, experts_implementation {f.implementation}; "
        f"{r.tokens:,} tokens a micro-batch on this rank):",
    ]
    for case in ROUTINGS:
        mark = "  <- the verdict" if case == r.assumed else ""
        lines.append(f"    {case + ' case':<14} {gib(r.peak(case, est.total)):>14}  {r.describe(case)}{mark}")
    other = next(c for c in ROUTINGS if c != r.assumed)
    lines.append(f"  the verdict uses the {r.assumed} case (--routing {other} for the other)")
    lines.append(f"  {r.why_equal()}")
    return lines


def format_dtype_table(total_params: int, gpu_mem: int, whose: str = "all") -> str:
    """The per-dtype table: whole-model parameters/gradients/Adam state per dtype on one GPU (``whose``:
    which parameters they are, "all" unless expert parallelism leaves a rank its share of the experts)."""
    lines = [
        f"Model states of {whose} {total_params:,} parameters on one GPU (no sharding, no activations):",
        f"    {'mode':<26} {'parameters':>12} {'gradients':>12} {'Adam state':>12} {'total':>12}  vs {gib(gpu_mem)}",
    ]
    for row in dtype_breakdown(total_params):
        total = float(row["total"])
        gap = total - gpu_mem
        status = f"short {gib(gap)} ({100 * gap / gpu_mem:.0f}% over)" if gap > 0 else f"fits, {gib(-gap)} spare"
        lines.append(
            f"    {row['mode']:<26} {gib(float(row['parameters'])):>12} {gib(float(row['gradients'])):>12} "
            f"{gib(float(row['optimizer_state'])):>12} {gib(total):>12}  {status}"
        )
    return "\n".join(lines)


__all__ = [
    "Allowance",
    "Verdict",
    "format_dtype_table",
    "format_estimate",
    "format_routing",
    "gib",
    "gpu_allowance",
    "parse_size",
    "verdict",
]
