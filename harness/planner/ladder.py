"""The memory ladder: every technique that lowers a step's memory, one rung each, in memory order.

`--recommend` walks the rungs from the top (the config as the user wrote it) down, each rung
adding its overrides to those of the rungs above it, estimates every rung with the planner's
normal estimate of that config (`harness.planner.estimate`: the traced step, the engine's
formulas; LoRA and QLoRA trace the LoRA model itself, `harness.planner.lora`), prints the
whole table and names the first rung that fits.

A rung is one data entry: a name, the overrides it applies, and the smallest world size it
means something at. Nothing else about a rung is code: its bytes are the estimate of the
config its overrides make, its step time the stated heuristics of `SPEED` (relative) and,
for the rungs that move the optimizer to the host, an absolute estimate of what the host's
part adds (:func:`offload_seconds`).

`{shard}` in an override is the strategy that shards at this world size: `fsdp` on several
ranks, `ddp` (one process) on one; `{more_sharding}` is one step further along the run's own
engine, read from its resolved strategy (DDP: FSDP2; DeepSpeed: its next ZeRO stage; the rung
is left out where nothing shards further); `{grad_clip}` is the user's own `optim.grad_clip`
(restored once a rung leaves optimizer-in-backward, which cannot clip); `{expert}` the expert-parallel
degree (`harness.planner.moe.expert_degree`: a mixture of experts under DDP or FSDP2). Expert
parallelism runs under DDP and FSDP2 with torch's own optimizers only, so the first rung that leaves
those (`with_experts` False: every optimizer and engine change, more sharding too unless it is DDP's
step to FSDP2, `experts_under_fsdp`) also sets `parallel.expert=1`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.config import (
    RunConfig,
    Strategy,
    StrategyFacts,
    facts_of,
    load_config,
    load_strategy,
    more_sharding,
)
from harness.errors import ConfigError
from harness.memory import ACTIVATION_CHECKPOINTING, CHECKPOINT_INPUT_OFFLOAD, CHUNKED_LOSS, TILED_MLP, Technique
from harness.planner.candidates import step_time_factor
from harness.planner.estimate import Estimate, estimate
from harness.planner.long_context import sequence_degree
from harness.planner.moe import expert_degree
from harness.planner.report import gib, gpu_allowance, verdict
from harness.planner.trace import PlanError


@dataclass(frozen=True)
class Rung:
    name: str
    overrides: tuple[str, ...]  # added to every rung's above it (a later one may undo an earlier one's)
    min_world: int = 1  # sharding means nothing on one rank
    max_world: int | None = None  # torchao's low-bit states on bf16 weights do not step under FSDP2 (refused)
    with_sequence: bool = True  # False: left out below the sequence-parallel rung (a combination the trainer refuses)
    with_experts: bool = False  # True: runs with the experts split (DDP or FSDP2, torch's optimizers); False: sets parallel.expert=1
    experts_under_fsdp: bool = False  # True: keeps them split where its strategy resolves to plain FSDP2 (more sharding from DDP)
    # True: only while the experts are split, and undone with the split (a later rung of its own turns it on again)
    while_split: bool = False

    @classmethod
    def of(cls, technique: Technique) -> Rung:
        """A memory technique's rung: its row's name and what turns it on (`harness.memory.techniques`)."""
        return cls(technique.name, technique.overrides(), with_experts=True)


RUNGS: tuple[Rung, ...] = (
    Rung("as configured", (), with_experts=True),
    Rung("bf16 mixed precision", ("precision=bf16",), with_experts=True),
    # a mixture of experts under DDP or FSDP2: each rank holds 1/{expert} of every MoE layer's experts
    Rung("expert parallelism (each rank its share of the experts)", ("parallel.expert={expert}",), min_world=2, with_experts=True),
    # recomputation with the experts split, before any rung that may leave them (more sharding from FSDP2
    # does); undone with the split, so that rung is judged without it
    Rung(
        f"{ACTIVATION_CHECKPOINTING.name}, the experts still split",
        ACTIVATION_CHECKPOINTING.overrides(),
        min_world=2,
        with_experts=True,
        while_split=True,
    ),
    Rung("more sharding (DDP: FSDP2; DeepSpeed: its next ZeRO stage)", ("strategy={more_sharding}",), min_world=2, experts_under_fsdp=True),
    Rung.of(ACTIVATION_CHECKPOINTING),
    Rung.of(CHUNKED_LOSS),
    # long sequences: activations that grow with seq_len, in cost order
    Rung.of(TILED_MLP),
    Rung.of(CHECKPOINT_INPUT_OFFLOAD),
    # each sample's sequence split over {sequence} ranks (the largest degree the world, the heads and
    # seq_len allow: `sequence_degree`); accumulation over {sequence} times the micro-batches keeps
    # the samples per optimizer step the user's
    Rung(
        "sequence parallelism (Ulysses; accumulation keeps the global batch)",
        ("parallel.sequence={sequence}", "grad_accum={sequence_accum}"),
        min_world=2,
    ),
    # refused under sequence parallelism (it would step before the shards' gradients are summed)
    Rung(
        "optimizer step inside backward (no gradient clipping)",
        ("memory.optimizer_in_backward=true", "optim.grad_clip=0"),
        with_sequence=False,
    ),
    Rung("bf16 optimizer states (torchao, stochastic rounding)", ("optim.name=adamw_bf16",)),
    Rung("pure bf16 weights: no fp32 master (stochastic rounding)", ("precision=bf16_pure",)),
    Rung("8-bit optimizer states (torchao)", ("optim.name=adamw_8bit",), max_world=1),
    Rung("4-bit optimizer states (torchao)", ("optim.name=adamw_4bit",), max_world=1),
    # bitsandbytes rounds its update into a bf16 weight to nearest, so precision=bf16_pure (reserved for
    # stochastic rounding) refuses it; one process under precision=bf16 holds the same bf16 weights with
    # no fp32 master (torchtune's single-GPU recipe). Refused under FSDP2 (DTensor shards): one rank only.
    Rung(
        "paged 8-bit states (bitsandbytes): states paged to the host",
        ("optim.name=paged_adamw_8bit", "precision=bf16"),
        max_world=1,
    ),
    Rung(
        "ZeRO-Offload: optimizer state and step on the host",
        (
            "strategy=zero2_offload",
            "optim.name=adamw",  # DeepSpeed's own CPU Adam (fp32 states, on the host)
            "precision=bf16",  # DeepSpeed keeps fp32 masters
            "memory.optimizer_in_backward=false",
            "optim.grad_clip={grad_clip}",
        ),
    ),
    Rung("ZeRO-3 offload: parameters too", ("strategy=zero3_offload",)),
    Rung("LoRA: bf16 base frozen, adapters trained", ("strategy={shard}", "lora.enabled=true", "memory.optimizer_in_backward=false")),
    Rung("QLoRA: NF4 base (bitsandbytes), sharded by FSDP2 on several ranks", ("strategy={shard}", "lora.quantize=nf4")),
    # Answer.AI's FSDP-QLoRA recipe for a 70B on two 24 GiB GPUs: the sharded base on the host too
    Rung("QLoRA + FSDP2 CPU offload: every shard on the host", ("strategy=fsdp_offload",)),
)

# Host-side cost of the offload rungs (stated assumptions, not measured on a GPU here):
PCIE_BYTES_PER_S = 25e9  # one GPU's host link, each direction: PCIe 4.0 x16 is 32 GB/s raw, ~25 GB/s in practice
# DeepSpeedCPUAdam on a server CPU: an 11.6B-parameter step in 8.2 s (deepspeedai/DeepSpeed#735, its
# author's measurement); notes/ladder.md has this machine's measured rate beside it.
CPU_ADAM_PARAMS_PER_S = 11.6e9 / 8.2


@dataclass
class RungResult:
    rung: Rung
    overrides: list[str]  # everything applied so far (the user's first)
    estimate: Estimate | None
    fits: bool
    device: int  # per-rank device bytes incl. the GPU allowance: the step's or loading's, the larger (0: not estimated)
    host: int  # per-node host bytes
    relative_time: float
    offload_s: float  # host part of a step on its own (0: nothing offloaded)
    reason: str


def net(overrides: list[str]) -> list[str]:
    """Overrides with each key once, at its last value (a later rung may undo an earlier one's)."""
    last: dict[str, str] = {}
    for o in overrides:
        key = o.split("=", 1)[0]
        last.pop(key, None)
        last[key] = o
    return list(last.values())


def rung_overrides(
    world: int,
    grad_clip: float = 1.0,
    strategy: Strategy | None = None,
    sequence: int = 1,
    grad_accum: int = 1,
    expert: int = 1,
    user_expert: int = 1,
) -> list[tuple[Rung, list[str]]]:
    """Each rung that applies at ``world`` with the overrides of it and every rung above it.
    ``strategy``: the run's resolved strategy (default DDP), which `{more_sharding}` continues;
    ``sequence``: the sequence-parallel rung's degree (1: no such rung, `sequence_degree`);
    ``grad_accum``: the user's, which that rung multiplies; ``expert``: the expert-parallel rung's
    degree (1: no such rung, `expert_degree`); ``user_expert``: the run's own `parallel.expert`."""
    further = more_sharding(StrategyFacts.of(strategy)) if strategy is not None else "fsdp"
    values = {
        "shard": "fsdp" if world > 1 else "ddp",
        "grad_clip": f"{grad_clip:g}",
        "more_sharding": further,
        "sequence": str(sequence),
        "sequence_accum": str(grad_accum * sequence),
        "expert": str(expert),
    }
    out, applied = [], []
    split = user_expert > 1  # the experts are split in the rungs so far
    scoped: list[str] = []  # what `while_split` rungs added, dropped when the experts leave
    for rung in RUNGS:
        if rung.while_split and not split:
            continue
        if world < rung.min_world or (rung.max_world is not None and world > rung.max_world):
            continue
        if further is None and any("{more_sharding}" in o for o in rung.overrides):
            continue
        if sequence == 1 and any("{sequence}" in o for o in rung.overrides):
            continue
        if sequence > 1 and not rung.with_sequence and "parallel.sequence=1" not in applied:
            continue
        if any("{expert}" in o for o in rung.overrides):
            if expert == user_expert or expert == 1:
                continue  # nothing to split, or split as the user asked already
            split = True
        added = [o.format(**values) for o in rung.overrides]
        if rung.while_split:
            scoped = scoped + added
        else:  # a rung of its own turns it on: no longer undone with the split
            scoped = [o for o in scoped if o not in added]
        applied = applied + added
        keeps = rung.with_experts or (rung.experts_under_fsdp and further == "fsdp")
        if split and not keeps:
            applied = [o for o in applied if o not in scoped] + ["parallel.expert=1"]
            split, scoped = False, []
        if out and sorted(net(applied)) == sorted(out[-1][1]):
            continue  # nothing new: a technique the user, or a rung above, already turned on
        out.append((rung, net(applied)))
    return out


def relative_time(cfg: RunConfig) -> float:
    """Expected step time relative to bf16 / DDP / no recomputation (`SPEED`: stated heuristics)."""
    mode = "none" if not cfg.lora.enabled else "lora" if cfg.lora.quantize == "none" else "nf4"
    mem = cfg.memory
    return step_time_factor(
        cfg.precision,
        mem.activation_checkpointing,
        facts_of(cfg.strategy).step_time,
        mode,
        cfg.parallel.sequence,
        tiled_mlp=mem.tiled_mlp > 1 or mem.tiled_mlp_tokens > 0,
        offload_checkpoint_inputs=mem.offload_checkpoint_inputs,
    )


def offload_seconds(
    cfg: RunConfig,
    params: int,
    world: int,
    per_node: int = 1,
    cpu_adam_rate: float = CPU_ADAM_PARAMS_PER_S,
    host_params: int = 0,
    strategy: Strategy | None = None,
) -> float:
    """What a step's host part adds, unoverlapped (an upper bound): the host Adam over the node's
    ranks' shares of the parameters at ``cpu_adam_rate`` per node (they share its cores), and the
    PCIe traffic at `PCIE_BYTES_PER_S`: ZeRO-2 offload sends each bit16 gradient down and each
    updated bit16 parameter up; ZeRO-3 offload also fetches every parameter for forward and
    again for backward (and writes the update on the host). LoRA under FSDP2's offload: the
    rank's shards (``host_params`` bytes, the base as held) fetched for forward and for backward;
    the adapters' host step is negligible. What is offloaded is read from the resolved strategy
    (``strategy``, default the config's resolved as the trainer resolves it): a user's own DeepSpeed
    file with CPU offload is costed as one."""
    facts = StrategyFacts.of(strategy) if strategy is not None else facts_of(cfg.strategy)
    if cfg.lora.enabled:
        return 2 * host_params / PCIE_BYTES_PER_S if facts.kind == "fsdp" and facts.offloads_params else 0.0
    if not (facts.offloads_optimizer or facts.offloads_params):
        return 0.0
    half = 2 if cfg.precision in ("bf16", "fp16") else 4
    part = math.ceil(params / world)
    per_param = 3 * half if facts.offloads_params else 2 * half
    return part * min(per_node, world) / cpu_adam_rate + part * per_param / PCIE_BYTES_PER_S


def walk_ladder(
    config: str | None,
    overrides: list[str],
    world: int,
    gpu_mem: int,
    *,
    cpu_mem: int | None = None,
    per_node: int | None = None,
    target: str = "cuda",
    vocab_size: int | None = None,
    cpu_adam_rate: float = CPU_ADAM_PARAMS_PER_S,
) -> list[RungResult]:
    """Every rung estimated (the table shows them all); the caller takes the first that fits."""
    per_node = per_node or world
    results = []
    user = load_config(config, overrides)
    try:
        strategy = load_strategy(user.strategy)
    except ConfigError:
        strategy = None  # the first rung, the config as written, reports it
    sequence = sequence_degree(user, world, vocab_size)
    # expert parallelism runs under DDP and FSDP2: its rung for such a run of a mixture of experts
    expert = expert_degree(user, world) if strategy is not None and strategy.kind in ("ddp", "fsdp") else 1
    rungs = rung_overrides(world, user.optim.grad_clip, strategy, sequence, user.grad_accum, expert, user.parallel.expert)
    for rung, applied in rungs:
        all_overrides = [*overrides, *applied]
        try:
            cfg = load_config(config, all_overrides)
            est = estimate(cfg, world, target=target, vocab_size=vocab_size)
        except (ConfigError, PlanError) as exc:
            results.append(RungResult(rung, all_overrides, None, False, 0, 0, 0.0, 0.0, str(exc)))
            continue
        v = verdict(est, gpu_mem, cpu_mem, per_node)
        params = est.params_total
        offload = offload_seconds(cfg, params, world, per_node, cpu_adam_rate, est.host.get("parameters", 0))
        step_need = est.total + (gpu_allowance(est).total if target == "cuda" else 0)
        device = max(v.device_need, step_need)  # the larger of loading and the step, whichever the verdict names
        results.append(RungResult(rung, all_overrides, est, v.fits, device, v.host_need_per_node, relative_time(cfg), offload, v.reason))
    return results


def first_fit(results: list[RungResult]) -> RungResult | None:
    return next((r for r in results if r.fits), None)


def format_ladder(
    results: list[RungResult], gpu_mem: int, cpu_mem: int | None, world: int, target: str, cpu_adam_rate: float = CPU_ADAM_PARAMS_PER_S
) -> str:
    unit = "GPU" if target == "cuda" else "rank"
    chosen = first_fit(results)
    width = max((len(r.rung.name) for r in results), default=4)  # whole names: a cut one can read as another rung
    lines = [
        f"Memory ladder ({world} x {gib(gpu_mem)} per {unit}"
        + (f", host {gib(cpu_mem)} per node" if cpu_mem else ", host memory not given: --cpu-mem checks it")
        + "): each rung adds its change to the rungs above it",
        f"  {'':2} {'rung':<{width}} {'device/' + unit:>13} {'host/node':>11} {'time':>6} {'offload':>9}  verdict",
    ]
    for r in results:
        mark = "->" if r is chosen else "  "
        device = gib(r.device) if r.estimate is not None else "-"
        time = f"x{r.relative_time:.2f}" if r.estimate is not None else "-"
        host = gib(r.host) if r.estimate is not None and r.host else "-"
        offload = f"+{r.offload_s:.1f} s" if r.offload_s else ""
        lines.append(f"  {mark} {r.rung.name:<{width}} {device:>13} {host:>11} {time:>6} {offload:>9}  {r.reason}")
    lines.append(
        "  time: expected step time relative to bf16/DDP/no recomputation (stated heuristics, harness.planner.candidates.SPEED); "
        f"offload: the host's part of a step on its own, unoverlapped (CPU Adam at {cpu_adam_rate / 1e9:.2f}G params/s per "
        f"node, PCIe {PCIE_BYTES_PER_S / 1e9:.0f} GB/s: assumed, see notes/ladder.md)"
    )
    return "\n".join(lines)


__all__ = [
    "CPU_ADAM_PARAMS_PER_S",
    "PCIE_BYTES_PER_S",
    "RUNGS",
    "Rung",
    "RungResult",
    "first_fit",
    "net",
    "format_ladder",
    "offload_seconds",
    "relative_time",
    "rung_overrides",
    "walk_ladder",
]
