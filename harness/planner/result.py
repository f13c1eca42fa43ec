"""What a plan answers: one rank's predicted peak (`Estimate`) and the moments of the step it is the
largest of (`Moment`), each by memory category; made by `harness.planner.estimate`, read by the
report, the ladder, the search and the OOM advice."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.config import RunConfig
from harness.memory import REPORTED
from harness.planner.moe import Routing

REPORT_CATS = (*REPORTED, "other")  # buffers count as "other" in a plan


@dataclass
class Moment:
    name: str
    categories: dict[str, int]  # device bytes by REPORT_CATS
    race: int = 0  # of which a collective buffer gloo's worker may still hold (see collective_race_bytes)

    @property
    def total(self) -> int:
        return sum(self.categories.values())


@dataclass
class Estimate:
    """One rank's predicted peak (the worst rank) and what fills it."""

    engine: str
    world_size: int
    rank: int
    peak: Moment  # the largest moment of the step on the device
    moments: list[Moment]  # forward/backward peak, end of backward, analytic phases
    host: dict[str, int]  # host bytes per rank held all step (offload); {} without offload
    host_peak: int  # per rank, during the step
    load_device: int  # per rank on the device while the model is built, sharded and filled (before the engine's state)
    load_host: int  # per rank on the host meanwhile
    target: str
    trace_seconds: float
    notes: list[str] = field(default_factory=list)
    params_total: int = 0
    largest_param: int = 0
    race_bytes: int = 0  # a real run peaks in [total - race_bytes, total]: the gloo-held buffers of collective_race_bytes
    # the run config as the run resolves it (what the launcher and a DeepSpeed file set taken in), which was estimated
    config: RunConfig | None = None
    routing: Routing | None = None  # a mixture of experts: where its tokens are assumed to go (harness.planner.moe)
    # bytes this rank sends per step in its forwards and backwards, by collective kind (harness.distributed.traffic);
    # None where not planned (DeepSpeed's engine)
    traffic: dict[str, int] | None = None

    @property
    def total(self) -> int:
        return self.peak.total
