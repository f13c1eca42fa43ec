"""What a strategy is, for every decision about it: read from the resolved strategy, never its name.

A run's strategy may be a shipped name (`zero2_offload`), a user's own DeepSpeed file
(`my_ds.json`) or nothing at all (an `accelerate launch --use_deepspeed` command, whose
choice arrives as environment variables). The planner's costing, the OOM advice and the
recommender decide on the facts `load_strategy` resolved (engine kind, ZeRO stage, what is
offloaded), so the three spellings of one strategy get the same answer. The shipped
strategies are the one catalogue the advice can point to: `shipped_equivalent` finds the
shipped strategy with a run's facts, `more_sharding` the one that shards one step further
in the same engine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from harness.config.strategies import Strategy, load_strategy, shipped_names, shipped_with

# Relative step time of each engine arrangement against DDP (lower is faster): stated heuristics,
# not measurements. Sharding adds collectives (ZeRO-3 / FSDP2 gather every parameter twice a step);
# offload adds PCIe traffic and a host optimizer step; NVMe adds disk I/O on top.
STEP_TIME = {
    ("ddp", 0): 1.0,
    ("deepspeed", 0): 1.0,
    ("deepspeed", 1): 1.0,
    ("deepspeed", 2): 1.01,
    ("fsdp", 2): 1.03,
    ("fsdp", 3): 1.06,
    ("deepspeed", 3): 1.10,
}
OPTIMIZER_OFFLOAD_TIME = 1.4  # the host's Adam and the gradients' trip down dominate
FSDP_OFFLOAD_TIME = 1.6  # FSDP2's CPUOffloadPolicy: every shard to the device and back, host step
PARAM_OFFLOAD_TIME = 2.0  # ZeRO-3 fetching every parameter from the host, twice a step
NVME_TIME = 4.0


@dataclass(frozen=True)
class StrategyFacts:
    """The engine facts of a resolved strategy: everything the planner and the advice decide on."""

    kind: str  # "ddp" | "fsdp" | "deepspeed" (the file's kind; one process of DDP is still "ddp")
    stage: int  # ZeRO stage equivalent: DDP 0, FSDP2 3 (2 without resharding), DeepSpeed its own
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_params: str = "none"

    @classmethod
    def of(cls, strategy: Strategy) -> StrategyFacts:
        return cls(strategy.kind, strategy.zero_stage, strategy.offload_optimizer, strategy.offload_params)

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer != "none"

    @property
    def offloads_params(self) -> bool:
        return self.offload_params != "none"

    @property
    def shards_params(self) -> bool:
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.stage == 3)

    @property
    def step_time(self) -> float:
        """Expected step time relative to DDP (`STEP_TIME` and the offload factors: heuristics)."""
        if "nvme" in (self.offload_optimizer, self.offload_params):
            return NVME_TIME
        if self.kind == "fsdp" and self.offloads_params:
            return FSDP_OFFLOAD_TIME
        if self.offloads_params:
            return PARAM_OFFLOAD_TIME
        if self.offloads_optimizer:
            return OPTIMIZER_OFFLOAD_TIME
        return STEP_TIME.get((self.kind, self.stage), 1.0)


@functools.cache
def shipped_facts(name: str) -> StrategyFacts:
    """A shipped strategy's facts, as its file says (no launcher's settings laid on)."""
    return StrategyFacts.of(load_strategy(name, env={}))


def facts_of(strategy: Strategy | str | None) -> StrategyFacts:
    """The facts of a resolved strategy, or of a name/path resolved as the trainer resolves it
    (None: the `accelerate launch` flags of this process, else DDP)."""
    return StrategyFacts.of(strategy if isinstance(strategy, Strategy) else load_strategy(strategy))


def shipped_equivalent(facts: StrategyFacts) -> str | None:
    """The shipped strategy with these facts (a user's own `my_ds.json` at ZeRO-2 with CPU optimizer
    offload is `zero2_offload` to the planner's tables), or None."""
    return shipped_with(facts.kind, facts.stage, facts.offload_optimizer, facts.offload_params)


# One step further along each engine's own sharding path: DDP's is FSDP2 (torch's engines).
_ZERO3_OFFLOAD = StrategyFacts("deepspeed", 3, "cpu", "cpu")
_MORE_SHARDING = {
    StrategyFacts("ddp", 0): StrategyFacts("fsdp", 3),
    StrategyFacts("fsdp", 2): StrategyFacts("fsdp", 3),
    StrategyFacts("deepspeed", 0): StrategyFacts("deepspeed", 1),
    StrategyFacts("deepspeed", 1): StrategyFacts("deepspeed", 2),
    StrategyFacts("deepspeed", 2): StrategyFacts("deepspeed", 3),
    StrategyFacts("deepspeed", 2, "cpu"): _ZERO3_OFFLOAD,
    StrategyFacts("deepspeed", 3): _ZERO3_OFFLOAD,
    StrategyFacts("deepspeed", 3, "cpu"): _ZERO3_OFFLOAD,
}


def more_sharding(facts: StrategyFacts) -> str | None:
    """The shipped strategy that shards (or offloads) one step further in the same engine, or None
    where nothing does (ZeRO-3 with parameters offloaded, FSDP2 resharding)."""
    further = _MORE_SHARDING.get(facts)
    return shipped_equivalent(further) if further is not None else None


__all__ = ["StrategyFacts", "facts_of", "more_sharding", "shipped_equivalent", "shipped_facts", "shipped_names"]
