"""Search for the fastest configuration that fits: the memory decision tree, automated.

The tree (fp32 fits? -> mixed precision -> activation checkpointing -> smaller micro-batch
with accumulation -> ZeRO/FSDP stages -> offload) is searched whole, but walked in order of
*expected speed* rather than in the tree's fixed order: on several GPUs ZeRO-2 costs less
than recomputing activations, so it is tried first. Every branch of the tree is a
dimension here: precision x activation checkpointing x micro-batch (global batch kept by
gradient accumulation) x strategy stage x offload.

Expected speed is a product of stated relative step-time factors (``SPEED``; a strategy's is
its resolved facts' `StrategyFacts.step_time`, harness.config.strategy_facts). They are
heuristics from published measurements, not measured here (no GPU on the development
machine): bf16 vs fp32 from the Peak Memory study (6.79 vs 2.52 samples/s), one extra
forward of recomputation for full checkpointing, communication volume of each stage
relative to DDP's all-reduce, PCIe traffic plus a CPU optimizer for offload.

Candidates whose model state alone (no activations) cannot fit are rejected without a
trace; the others are estimated (traces are cached and shared by every strategy that runs
the bare module), until ``max_fits`` fitting configurations are found.

When no full fine-tune fits, the tree's last two steps follow, in order: LoRA (frozen bf16
base, adapters trained; `harness.planner.lora`) and QLoRA (NF4 base, bitsandbytes; sharded by
FSDP2 at world > 1). They change what is trained, not only how, so they are never chosen for
speed over a full fine-tune that fits; the first that fits is named.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Any

import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config import (
    RunConfig,
    StrategyFacts,
    apply_overrides,
    check_strategy_against_run,
    check_values,
    facts_of,
    load_config,
    load_strategy,
    shipped_equivalent,
    shipped_facts,
    shipped_names,
)
from harness.errors import ConfigError
from harness.planner.estimate import Estimate, estimate, resolve_vocab, specs_for, walk
from harness.planner.model_states import engine_model, fsdp_local_numel
from harness.planner.report import CUDA_CONTEXT, FRAGMENTATION, LIBRARY_WORKSPACES, NCCL_BUFFERS, gib, verdict
from harness.planner.trace import ParamInfo, TraceResult, build_fake_model, param_info
from harness.training import DTYPE_BYTES

# Relative step time (lower is faster); see the module docstring for where each comes from.
SPEED: dict[str, dict[str, float]] = {
    "precision": {"bf16": 1.0, "bf16_pure": 1.0, "fp16": 1.05, "fp32": 2.7},
    "ac": {"none": 1.0, "op": 1.08, "selective": 1.15, "full": 1.33},
}
# The tree's last steps (LoRA, then QLoRA): taken only when no full fine-tune fits. NF4 costs a
# dequantization per matmul (QLoRA paper: slower than 16-bit LoRA); an assumed factor.
SPEED["lora"] = {"none": 1.0, "lora": 1.0, "nf4": 1.3}
# Long-sequence knobs (stated, not measured here): the tiled MLP runs one more MLP forward (~2/3 of a
# block's linear FLOPs, a forward being ~1/4 of a checkpointed step: +~15%, less where attention's
# s^2 term dominates); checkpoint-input offload overlaps its copies on a side stream (accelerate
# measured +0.6% on Qwen3-0.6B at 1M tokens); sequence parallelism (assumed, per step with the
# global batch kept by accumulation: each rank computes the same tokens, plus four all-to-alls of
# attention's q/k/v/output per block each way, on NVLink a small share of a block's time).
SPEED["memory"] = {"tiled_mlp": 1.15, "offload_checkpoint_inputs": 1.01, "sequence_parallel": 1.05}
LORA_STEPS = ("lora", "nf4")
MICRO_BATCH_HALVING = 0.05  # each halving of the micro-batch: ~5% lower GPU efficiency


@dataclass(frozen=True)
class Candidate:
    precision: str
    ac: str
    micro_batch: int
    grad_accum: int
    strategy: str
    lora: str = "none"  # none (full fine-tune) | lora | nf4 (QLoRA)

    def overrides(self) -> list[str]:
        out = [
            f"precision={self.precision}",
            f"memory.activation_checkpointing={self.ac}",
            f"micro_batch_size={self.micro_batch}",
            f"grad_accum={self.grad_accum}",
            f"strategy={self.strategy}",
        ]
        if self.ac == "selective":
            out.append("memory.ac_every=2")
        if self.lora != "none":
            out += ["lora.enabled=true", f"lora.quantize={'nf4' if self.lora == 'nf4' else 'none'}"]
        return out

    def cost(self, base_micro: int) -> float:
        halvings = math.log2(base_micro / self.micro_batch) if self.micro_batch < base_micro else 0.0
        return (
            SPEED["precision"][self.precision]
            * SPEED["ac"][self.ac]
            * shipped_facts(self.strategy).step_time
            * SPEED["lora"][self.lora]
            * (1 + MICRO_BATCH_HALVING * halvings)
        )

    def label(self) -> str:
        ac = f"AC {self.ac}" if self.ac != "none" else "no AC"
        tuned = {"none": "", "lora": ", LoRA (base frozen)", "nf4": ", QLoRA (NF4 base, bitsandbytes)"}
        return f"{self.strategy}, {self.precision}, {ac}, micro-batch {self.micro_batch} x accum {self.grad_accum}{tuned[self.lora]}"


@dataclass
class Evaluated:
    candidate: Candidate
    cost: float
    fits: bool
    need: int  # per-GPU bytes incl. allowance (or the model-state lower bound when pruned)
    reason: str
    estimate: Estimate | None = None


@dataclass
class Recommendation:
    fits: list[Evaluated]
    evaluated: list[Evaluated]
    why: dict[Candidate, list[str]] = field(default_factory=dict)

    @property
    def best(self) -> Evaluated | None:
        return self.fits[0] if self.fits else None


def strategies_for(world: int, nvme: bool, target: str) -> list[str]:
    """The shipped strategies that mean something at this world size on this target, read from
    their facts: NVMe offload only where there is NVMe; on one rank sharding alone gains nothing,
    so DDP and DeepSpeed's offload (FSDP2's offload is searched from two ranks on)."""

    def meaningful(facts: StrategyFacts) -> bool:
        if "nvme" in (facts.offload_optimizer, facts.offload_params):
            return nvme
        return world > 1 or facts.kind == "ddp" or (facts.kind == "deepspeed" and facts.offloads_optimizer)

    return [name for name in shipped_names() if meaningful(shipped_facts(name))]


def runs_with(cfg: RunConfig, strategy_name: str, target: str) -> bool:
    """Whether the run's optimizer and precision may run under this strategy (the config checks'
    rule: DeepSpeed runs only its own optimizers, bitsandbytes cannot step FSDP2 shards, ...)."""
    try:
        check_strategy_against_run(load_strategy(strategy_name), cfg, has_accelerator=target == "cuda")
    except ConfigError:
        return False
    return True


def candidates(cfg: RunConfig, world: int, nvme: bool, target: str) -> list[Candidate]:
    precisions = sorted({cfg.precision, "bf16"}, key=lambda p: SPEED["precision"][p])
    acs = ["none", "op", "selective", "full"]
    micro, accum = cfg.micro_batch_size, cfg.grad_accum
    micros = sorted({micro} | {micro >> k for k in range(1, micro.bit_length()) if micro >> k >= 1}, reverse=True)
    out = []
    for p in precisions:
        for ac in acs:
            for m in micros:
                new_accum = max(1, math.ceil(micro * accum / m))
                for s in [s for s in strategies_for(world, nvme, target) if runs_with(cfg, s, target)]:
                    out.append(Candidate(p, ac, m, new_accum, s))
    return sorted(out, key=lambda c: c.cost(micro))


def _model_state_floor(cfg: RunConfig, world: int, target: str, info: ParamInfo, vocab: int | None) -> int:
    """Per-rank peak with zero activations: a lower bound that needs no trace."""
    strategy = load_strategy(cfg.strategy)
    tspec, espec = specs_for(cfg, strategy, world, info.hidden_size, target, vocab)
    if tspec.wrap == "fsdp":
        params = sum(fsdp_local_numel(s, world, 0) for s in info.shapes) * 4
        grads = params
    else:
        params = info.total * DTYPE_BYTES.get(tspec.module_dtype, 4)
        grads = params
    rows = [(params, 0, 0, 0, 0, 0, 0, 0), (params, 0, grads, 0, 0, 0, 0, 0)]
    synthetic = TraceResult(tspec, rows, [0, 1], [0, 0], ["model"], info)
    em = engine_model(espec, info, 0)
    return max(m.total for m in walk(synthetic, em, cpu_run=target == "cpu"))


def recommend(
    cfg: RunConfig,
    world: int,
    gpu_mem: int,
    *,
    cpu_mem: int | None = None,
    gpus_per_node: int | None = None,
    nvme: bool = False,
    target: str = "cuda",
    vocab_size: int | None = None,
    max_fits: int = 5,
    max_traced: int = 40,
    info: ParamInfo | None = None,
) -> Recommendation:
    """Walk the candidates fastest-first; estimate those whose model state could fit; keep the fitting ones."""

    per_node = gpus_per_node or world
    vocab = vocab_size or resolve_vocab(cfg)
    info = info or _param_info(cfg, vocab)
    results: dict[Candidate, Evaluated] = {}
    fits: list[Evaluated] = []
    traced = 0

    def evaluate(c: Candidate) -> Evaluated:
        nonlocal traced
        if c in results:
            return results[c]
        if c.lora != "none":
            results[c] = evaluate_lora(cfg, c, world, gpu_mem, target, vocab, info, cpu_mem=cpu_mem, per_node=per_node)
            return results[c]
        run = with_candidate(cfg, c)
        cost = c.cost(cfg.micro_batch_size)
        floor = _model_state_floor(run, world, target, info, vocab)
        floor_need = floor + (gpu_allowance_for(floor, world) if target == "cuda" else 0)
        if floor_need > gpu_mem:
            ev = Evaluated(c, cost, False, floor_need, f"model state + GPU allowance alone need {gib(floor_need)} > {gib(gpu_mem)}")
        else:
            est = estimate(run, world, target=target, vocab_size=vocab)
            traced += 1
            v = verdict(est, gpu_mem, cpu_mem, per_node)
            ev = Evaluated(c, cost, v.fits, v.device_need, v.reason, est)
        results[c] = ev
        return ev

    ordered = candidates(cfg, world, nvme, target)
    for c in ordered:
        if len(fits) >= max_fits or traced >= max_traced:
            break
        ev = evaluate(c)
        if ev.fits:
            fits.append(ev)
    if not fits:
        # The trace budget may end before the slowest, most frugal corner: settle "nothing fits" there.
        frugal = evaluate(most_frugal(cfg, world, nvme, target))
        if frugal.fits:
            fits.append(frugal)
    full_fits = bool(fits)
    for c in [] if fits else lora_candidates(cfg, world):  # the tree's last steps, in order: the first that fits
        ev = evaluate(c)
        if ev.fits:
            fits.append(ev)
            break
    rec = Recommendation(fits, list(results.values()))
    for ev in fits[:1]:
        rec.why[ev.candidate] = explain(cfg, ev.candidate, evaluate)
        if not full_fits:
            rec.why[ev.candidate].insert(
                0,
                "no full fine-tune fits, not even the most frugal (bf16, full recomputation, "
                "micro-batch 1, everything offloaded): the adapters train, the base is frozen",
            )
    return rec


def lora_candidates(cfg: RunConfig, world: int) -> list[Candidate]:
    """LoRA then QLoRA; within each, the user's micro-batch without recomputation before the most frugal."""
    out = []
    for mode in LORA_STEPS:
        for ac, micro in (("none", cfg.micro_batch_size), ("full", 1)):
            accum = max(1, math.ceil(cfg.micro_batch_size * cfg.grad_accum / micro))
            for strategy in ("ddp", "fsdp") if world > 1 else ("ddp",):
                out.append(Candidate("bf16", ac, micro, accum, strategy, lora=mode))
    return out


def evaluate_lora(
    cfg: RunConfig,
    c: Candidate,
    world: int,
    gpu_mem: int,
    target: str,
    vocab: int | None,
    info: ParamInfo,
    cpu_mem: int | None = None,
    per_node: int = 1,
) -> Evaluated:
    """A LoRA/QLoRA candidate, estimated like any config: the LoRA model itself is traced
    (`harness.planner.lora`); QLoRA's quantized base is a formula over that trace."""
    cost = c.cost(cfg.micro_batch_size)
    run = with_candidate(cfg, c)
    est = estimate(run, world, target=target, vocab_size=vocab)
    v = verdict(est, gpu_mem, None, per_node)
    adapters = f"{est.params_total / 1e6:.2f}M adapter parameters (r={cfg.lora.r})"
    if not v.fits:
        return Evaluated(c, cost, False, v.device_need, f"{v.reason} ({adapters})", est)
    # LoRA and QLoRA under torch's engines are built on the meta device and filled (QLoRA: quantized)
    # a tensor at a time, like a full fine-tune, and so is ZeRO-3's base (under zero.Init); ZeRO-1/2
    # build the frozen base whole in fp32 on the host.
    facts = shipped_facts(c.strategy)
    meta_built = facts.kind != "deepspeed" or facts.stage == 3
    host = (info.whole_largest if meta_built else info.total + info.frozen) * 4 * per_node
    if cpu_mem is not None and host > cpu_mem:
        return Evaluated(c, cost, False, v.device_need, f"needs {gib(host)} host memory per node to build the model > {gib(cpu_mem)}", est)
    return Evaluated(
        c,
        cost,
        True,
        v.device_need,
        f"fits: {gib(v.device_need)} of {gib(gpu_mem)} per {'GPU' if target == 'cuda' else 'rank'} "
        f"({adapters}; parameters incl. the frozen base {gib(est.peak.categories['parameters'])})",
        est,
    )


def most_frugal(cfg: RunConfig, world: int, nvme: bool, target: str = "cuda") -> Candidate:
    """bf16, full recomputation, micro-batch 1 (same global batch), everything offloaded: ZeRO-3's
    offload, or where the run's optimizer cannot run under DeepSpeed, FSDP2's (then plain FSDP2, DDP)."""
    corners = ["zero3_nvme" if nvme else "zero3_offload", "fsdp_offload" if target == "cuda" else "fsdp", "fsdp", "ddp"]
    strategy = next((s for s in corners if runs_with(cfg, s, target)), "ddp")
    return Candidate("bf16", "full", 1, max(1, cfg.micro_batch_size * cfg.grad_accum), strategy)


def gpu_allowance_for(peak: int, world: int) -> int:
    """The report's GPU allowance for a bare number (used on lower bounds)."""

    return CUDA_CONTEXT + (NCCL_BUFFERS if world > 1 else 0) + LIBRARY_WORKSPACES + int(FRAGMENTATION * peak)


def explain(cfg: RunConfig, chosen: Candidate, evaluate: Any) -> list[str]:
    """For each way ``chosen`` departs from the user's config: what undoing only that change costs.
    The user's strategy is the shipped one with its resolved facts (a DeepSpeed run launched without
    `strategy:`, or a user's own file, is compared as the DeepSpeed stage and offload it is)."""
    own = facts_of(cfg.strategy)
    user = {
        "precision": cfg.precision,
        "ac": cfg.memory.activation_checkpointing,
        "micro_batch": cfg.micro_batch_size,
        "strategy": shipped_equivalent(own) or cfg.strategy or own.kind,
    }
    names = {"precision": "precision", "ac": "activation checkpointing", "micro_batch": "micro-batch", "strategy": "strategy"}
    reasons = []
    for dim, theirs in user.items():
        ours = getattr(chosen, dim)
        if ours == theirs:
            continue
        if dim == "ac" and theirs not in SPEED["ac"]:
            continue
        back = replace(chosen, **{dim: theirs})
        if dim == "micro_batch":
            back = replace(back, grad_accum=cfg.grad_accum)
        if dim == "strategy" and shipped_equivalent(own) is None:
            reasons.append(f"{names[dim]} {theirs} -> {ours}: a shipped strategy the planner can rank")
            continue
        ev = evaluate(back)
        if ev.fits:
            reasons.append(
                f"{names[dim]} {theirs} -> {ours}: expected faster ({ev.cost / chosen.cost(cfg.micro_batch_size):.2f}x "
                "the step time with the change undone), both fit"
            )
        else:
            reasons.append(f"{names[dim]} {theirs} -> {ours}: without this change {ev.reason}")
    return reasons


def with_candidate(cfg: RunConfig, c: Candidate) -> RunConfig:
    """``cfg`` with the candidate's five settings; every other setting kept."""
    memory = dataclasses.replace(cfg.memory, activation_checkpointing=c.ac, ac_every=2 if c.ac == "selective" else cfg.memory.ac_every)
    lora = cfg.lora if c.lora == "none" else dataclasses.replace(cfg.lora, enabled=True, quantize="nf4" if c.lora == "nf4" else "none")
    run = dataclasses.replace(
        cfg,
        precision=c.precision,
        micro_batch_size=c.micro_batch,
        grad_accum=c.grad_accum,
        strategy=c.strategy,
        memory=memory,
        global_batch_size=None,
        lora=lora,
    )
    check_values(run)
    return run


def _param_info(cfg: RunConfig, vocab: int | None) -> ParamInfo:
    return param_info(build_fake_model(cfg.model.name, vocab, FakeTensorMode()))


def recommended_config(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The user's config file contents + their overrides + the chosen settings' (after them), as a config mapping."""
    data = apply_overrides(copy.deepcopy(raw), list(overrides))
    data.pop("global_batch_size", None)  # implied by micro * accum * world; a stale value would contradict
    return data


def write_recommended(path: str, data: dict[str, Any], header: str) -> None:
    """Write the config as YAML and load it back with the trainer's loader: it must launch as is."""
    with open(path, "w") as f:
        f.write("".join(f"# {line}\n" for line in header.splitlines()))
        yaml.safe_dump(data, f, sort_keys=False, default_flow_style=False)
    load_config(path)


__all__ = [
    "Candidate",
    "Evaluated",
    "LORA_STEPS",
    "Recommendation",
    "SPEED",
    "candidates",
    "evaluate_lora",
    "lora_candidates",
    "most_frugal",
    "recommend",
    "recommended_config",
    "strategies_for",
    "with_candidate",
    "write_recommended",
]
