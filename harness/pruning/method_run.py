"""What a pruning method is to the pipeline: its facts (`harness.config.MethodFacts`) and a `run`
over one `MethodRun`, the state `run_pruning` prepared for it. A new method is a module with
its `run`, one row of facts and one entry in `harness.pruning.registry`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.config import MethodFacts, PruneConfig
from harness.distributed import Collectives
from harness.pruning.calibration import Ledger, Runner
from harness.pruning.masks import MaskSet
from harness.pruning.methods import Rule
from harness.pruning.shards import ShardView


@dataclass
class MethodRun:
    """Everything a method reads, prepared once by `run_pruning` for every method alike."""

    cfg: PruneConfig  # resolved: every key the decision mode fills is set
    groups: list[list[ShardView]]  # the views probed/measured together, in order
    rule: Rule  # the selection's shape and target
    forced: dict[str, torch.Tensor]  # local masks that stay pruned (earlier rounds, reloaded masks)
    runner: Runner  # forward / probe passes through the trainer's own model or engine
    batches: list[Any]  # this rank's calibration micro-batches
    comm: Collectives
    ledger: Ledger  # the pipeline's own buffers, for the report's probe memory
    allocation: dict[str, float] | None = None  # per-matrix sparsities (OWL); None: uniform
    details: dict[str, Any] = field(default_factory=dict)  # what the method reports beyond its masks (the report's `details`)

    @property
    def sequential(self) -> bool:
        """Each group's masks are applied before the next group is measured."""
        return bool(self.cfg.sequential)


@dataclass(frozen=True)
class Method:
    """One registry entry: what the method is (`facts`) and how it runs (`run` -> this rank's masks)."""

    facts: MethodFacts
    run: Callable[[MethodRun], MaskSet]
