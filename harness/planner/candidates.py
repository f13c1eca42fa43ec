"""The search space of `harness.plan --recommend --fastest`: one candidate per combination of
precision x activation checkpointing x micro-batch x strategy (stage and offload) x sequence split
x expert split (a mixture of experts, under DDP or FSDP2), each with the accumulation that keeps the user's
samples per optimizer step, and its expected step time.

Expected speed is a product of stated relative step-time factors (``SPEED``; a strategy's is
its resolved facts' `StrategyFacts.step_time`, harness.config.strategy_facts). They are
heuristics from published measurements, not measured here (no GPU on the development
machine): bf16 vs fp32 from the Peak Memory study (6.79 vs 2.52 samples/s), one extra
forward of recomputation for full checkpointing, communication volume of each stage
relative to DDP's all-reduce, PCIe traffic plus a CPU optimizer for offload.

A candidate is only offered where the trainer would run it: the config checks decide (DeepSpeed
runs its own optimizers; harness's Ulysses runs under the torch engines, without pruning or
optimizer-in-backward; expert parallelism under DDP or FSDP2 with torch's optimizers), never a strategy's
name. Expert parallelism is costed as its strategy (an assumption: each MoE layer's tokens cross the
ranks twice each way, taken as free beside the strategy's own traffic; not measured).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from harness.config import (
    ParallelLayout,
    RunConfig,
    StrategyFacts,
    check_expert_parallel,
    check_sequence_parallel,
    check_strategy_against_run,
    check_values,
    load_strategy,
    shipped_facts,
    shipped_names,
)
from harness.errors import ConfigError
from harness.memory import AC_STEP_TIME, CHECKPOINT_INPUT_OFFLOAD, TILED_MLP
from harness.planner.long_context import sequence_degree
from harness.planner.moe import expert_degree

# Relative step time (lower is faster); see the module docstring for where each comes from.
SPEED: dict[str, dict[str, float]] = {
    "precision": {"bf16": 1.0, "bf16_pure": 1.0, "fp16": 1.05, "fp32": 2.7},
    "ac": AC_STEP_TIME,  # the memory techniques' factors are their rows' (`harness.memory.techniques`)
}
# The tree's last steps (LoRA, then QLoRA): taken only when no full fine-tune fits. NF4 costs a
# dequantization per matmul (QLoRA paper: slower than 16-bit LoRA); an assumed factor.
SPEED["lora"] = {"none": 1.0, "lora": 1.0, "nf4": 1.3}
# Sequence parallelism (assumed, per step with the global batch kept by accumulation: each rank computes the
# same tokens, plus four all-to-alls of attention's q/k/v/output per block each way, on NVLink a
# small share of a block's time; x1.43 measured on CPU over gloo, 3 ranks sharing 2 cores, which
# says nothing of NVLink).
SPEED["memory"] = {
    "tiled_mlp": TILED_MLP.step_time,
    "offload_checkpoint_inputs": CHECKPOINT_INPUT_OFFLOAD.step_time,
    "sequence_parallel": 1.05,
}
LORA_STEPS = ("lora", "nf4")
MICRO_BATCH_HALVING = 0.05  # each halving of the micro-batch: ~5% lower GPU efficiency


def step_time_factor(
    precision: str,
    ac: str,
    strategy_step_time: float,
    lora: str = "none",
    sequence: int = 1,
    tiled_mlp: bool = False,
    offload_checkpoint_inputs: bool = False,
) -> float:
    """Expected step time relative to bf16 / DDP / no recomputation: the product of `SPEED`'s
    stated factors, the one rule the search's candidates and the ladder's rungs are both costed by."""
    memory = SPEED["memory"]
    return (
        SPEED["precision"].get(precision, 1.0)
        * SPEED["ac"].get(ac, 1.0)
        * strategy_step_time
        * SPEED["lora"][lora]
        * (memory["sequence_parallel"] if sequence > 1 else 1.0)
        * (memory["tiled_mlp"] if tiled_mlp else 1.0)
        * (memory["offload_checkpoint_inputs"] if offload_checkpoint_inputs else 1.0)
    )


@dataclass(frozen=True)
class Candidate:
    precision: str
    ac: str
    micro_batch: int
    grad_accum: int
    strategy: str
    lora: str = "none"  # none (full fine-tune) | lora | nf4 (QLoRA)
    sequence: int = 1  # each sample split over this many ranks (Ulysses); 1: whole sequences
    expert: int = 1  # each MoE layer's experts split over this many ranks; 1: every rank holds them all

    def overrides(self) -> list[str]:
        out = [
            f"precision={self.precision}",
            f"memory.activation_checkpointing={self.ac}",
            f"micro_batch_size={self.micro_batch}",
            f"grad_accum={self.grad_accum}",
            f"strategy={self.strategy}",
            f"parallel.sequence={self.sequence}",
            f"parallel.expert={self.expert}",
        ]
        if self.ac == "selective":
            out.append("memory.ac_every=2")
        if self.lora != "none":
            out += ["lora.enabled=true", f"lora.quantize={'nf4' if self.lora == 'nf4' else 'none'}"]
        return out

    def cost(self, base_micro: int) -> float:
        halvings = math.log2(base_micro / self.micro_batch) if self.micro_batch < base_micro else 0.0
        factor = step_time_factor(self.precision, self.ac, shipped_facts(self.strategy).step_time, self.lora, self.sequence)
        return factor * (1 + MICRO_BATCH_HALVING * halvings)

    def label(self) -> str:
        ac = f"AC {self.ac}" if self.ac != "none" else "no AC"
        tuned = {"none": "", "lora": ", LoRA (base frozen)", "nf4": ", QLoRA (NF4 base, bitsandbytes)"}
        split = f", sequence over {self.sequence} ranks" if self.sequence > 1 else ""
        split += f", experts over {self.expert} ranks" if self.expert > 1 else ""
        return f"{self.strategy}, {self.precision}, {ac}, micro-batch {self.micro_batch} x accum {self.grad_accum}{split}{tuned[self.lora]}"


def strategies_for(world: int, nvme: bool, target: str) -> list[str]:
    """The shipped strategies that mean something at this world size on this target, read from
    their facts: NVMe offload only where there is NVMe; on one rank sharding alone gains nothing,
    so DDP and DeepSpeed's offload (FSDP2's offload is searched from two ranks on)."""

    def meaningful(facts: StrategyFacts) -> bool:
        if "nvme" in (facts.offload_optimizer, facts.offload_params):
            return nvme
        return world > 1 or facts.kind == "ddp" or (facts.kind == "deepspeed" and facts.offloads_optimizer)

    return [name for name in shipped_names() if meaningful(shipped_facts(name))]


def runs_with(cfg: RunConfig, strategy_name: str, target: str, sequence: int = 1, world: int = 1, expert: int = 1) -> bool:
    """Whether the run's optimizer and precision may run under this strategy (the config checks'
    rule: DeepSpeed runs only its own optimizers, bitsandbytes cannot step FSDP2 shards, ...),
    with each sample split over ``sequence`` ranks of ``world`` (refused with pruning, with
    optimizer-in-backward): under DeepSpeed that is ALST, whose per-rank peak the planner's trace
    predicts with and without offload (test_planner_accuracy); and with the experts split over
    ``expert`` ranks (DDP or FSDP2 with torch's optimizers only)."""
    trial = with_split(cfg, sequence, expert)
    strategy = load_strategy(strategy_name)
    try:
        check_strategy_against_run(strategy, trial, has_accelerator=target == "cuda")
        check_sequence_parallel(trial, strategy, world)
        check_expert_parallel(trial, strategy, world)
    except ConfigError:
        return False
    return True


def with_split(cfg: RunConfig, sequence: int, expert: int = 1) -> RunConfig:
    """``cfg`` with each sample split over ``sequence`` ranks and the experts over ``expert``."""
    if (sequence, expert) == (cfg.parallel.sequence, cfg.parallel.expert):
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence=sequence, expert=expert))


def accum_for(cfg: RunConfig, micro: int, sequence: int) -> int:
    """The accumulation that keeps the user's samples per optimizer step with ``micro`` samples a
    micro-batch, each split over ``sequence`` ranks: a sequence group reads what one rank did."""
    return max(1, math.ceil(cfg.micro_batch_size * cfg.grad_accum * sequence / (micro * cfg.parallel.sequence)))


def sequence_choices(cfg: RunConfig, world: int, vocab: int | None = None) -> list[int]:
    """Whole sequences, and the split the user asked for or else the largest the world allows."""
    asked = ParallelLayout.of(cfg.parallel, world)
    split = asked.sequence if asked.splits_sequences else sequence_degree(cfg, world, vocab)
    return sorted({1, split})


def candidates(cfg: RunConfig, world: int, nvme: bool, target: str, vocab: int | None = None) -> list[Candidate]:
    precisions = sorted({cfg.precision, "bf16"}, key=lambda p: SPEED["precision"][p])
    acs = ["none", "op", "selective", "full"]
    micro = cfg.micro_batch_size
    micros = sorted({micro} | {micro >> k for k in range(1, micro.bit_length()) if micro >> k >= 1}, reverse=True)
    splits = [(n, e) for n in sequence_choices(cfg, world, vocab) for e in sorted({1, expert_degree(cfg, world)})]
    runnable = [(s, n, e) for n, e in splits for s in strategies_for(world, nvme, target) if runs_with(cfg, s, target, n, world, e)]
    out = []
    for p in precisions:
        for ac in acs:
            for m in micros:
                for s, n, e in runnable:
                    out.append(Candidate(p, ac, m, accum_for(cfg, m, n), s, sequence=n, expert=e))
    return sorted(out, key=lambda c: c.cost(micro))


def lora_candidates(cfg: RunConfig, world: int) -> list[Candidate]:
    """LoRA then QLoRA; within each, the user's micro-batch without recomputation before the most frugal."""
    out = []
    for mode in LORA_STEPS:
        for ac, micro in (("none", cfg.micro_batch_size), ("full", 1)):
            accum = max(1, math.ceil(cfg.micro_batch_size * cfg.grad_accum / micro))
            for strategy in ("ddp", "fsdp") if world > 1 else ("ddp",):
                out.append(Candidate("bf16", ac, micro, accum, strategy, lora=mode))
    return out


def most_frugal(cfg: RunConfig, world: int, nvme: bool, target: str = "cuda") -> Candidate:
    """bf16, full recomputation, micro-batch 1 (same global batch), everything offloaded: ZeRO-3's
    offload, or where the run's optimizer cannot run under DeepSpeed, FSDP2's (then plain FSDP2, DDP);
    whole sequences, and every expert on every rank (the offloading engines do not split them)."""
    corners = ["zero3_nvme" if nvme else "zero3_offload", "fsdp_offload" if target == "cuda" else "fsdp", "fsdp", "ddp"]
    strategy = next((s for s in corners if runs_with(cfg, s, target)), "ddp")
    return Candidate("bf16", "full", 1, accum_for(cfg, 1, 1), strategy)


def with_candidate(cfg: RunConfig, c: Candidate) -> RunConfig:
    """``cfg`` with the candidate's settings; every other setting kept."""
    memory = dataclasses.replace(cfg.memory, activation_checkpointing=c.ac, ac_every=2 if c.ac == "selective" else cfg.memory.ac_every)
    lora = cfg.lora if c.lora == "none" else dataclasses.replace(cfg.lora, enabled=True, quantize="nf4" if c.lora == "nf4" else "none")
    run = dataclasses.replace(
        with_split(cfg, c.sequence, c.expert),
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


__all__ = [
    "LORA_STEPS",
    "SPEED",
    "step_time_factor",
    "Candidate",
    "accum_for",
    "candidates",
    "lora_candidates",
    "most_frugal",
    "runs_with",
    "sequence_choices",
    "strategies_for",
    "with_candidate",
    "with_split",
]
