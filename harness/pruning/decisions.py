"""GradProbe's decisions, by name (`prune.decision`): the one catalogue GradProbe dispatches through,
as `harness.pruning.registry` is the methods'.

Each entry pairs the decision's facts (`harness.config.DECISION_FACTS`: what the config checks
read) with the keys it ranks one matrix's candidate pool by (lowest pruned first, outside the pool
last). The original decision has no keys: it prunes below a threshold and undershoots
(`harness.pruning.methods.original_decision`). To add a decision: its facts' row, its entry here,
its name in the config's `PruneDecision` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.config import DECISION_FACTS, DecisionFacts
from harness.pruning.experimental import exact_keys, saliency_keys
from harness.pruning.methods import veto_keys


@dataclass(frozen=True)
class MatrixProbe:
    """What the probe passes measured for one matrix, as its decision reads it."""

    pool: torch.Tensor  # the candidates
    g0: torch.Tensor  # gradient maxima before the candidates are scaled down
    g1: torch.Tensor  # and after
    base: torch.Tensor  # the base score (ties)
    forced: torch.Tensor | None  # weights already pruned (kept pruned)
    weight: torch.Tensor | None = None  # saliency reads the weights and the gradient sums
    sum0: torch.Tensor | None = None
    sum1: torch.Tensor | None = None


@dataclass(frozen=True)
class Decision:
    facts: DecisionFacts
    keys: Callable[[MatrixProbe, float, float], torch.Tensor] | None  # (probe, threshold, reduction) -> keys


def _saliency(m: MatrixProbe, threshold: float, reduction: float) -> torch.Tensor:
    assert m.weight is not None and m.sum0 is not None and m.sum1 is not None, "saliency reads the probe's sums"
    return saliency_keys(m.pool, m.weight, m.sum0, m.sum1, reduction, m.forced)


_KEYS: dict[str, Callable[[MatrixProbe, float, float], torch.Tensor] | None] = {
    "veto": lambda m, threshold, reduction: veto_keys(m.pool, m.g0, m.g1, m.base, threshold, m.forced),
    "rank": lambda m, threshold, reduction: exact_keys(m.pool, m.g0, m.g1, m.base, m.forced),
    "saliency": _saliency,
    "original": None,
}

DECISIONS: dict[str, Decision] = {name: Decision(DECISION_FACTS[name], keys) for name, keys in _KEYS.items()}


def decision_keys(name: str, probe: MatrixProbe, threshold: float, reduction: float) -> torch.Tensor:
    """One matrix's exact-target keys under the decision `name`."""
    keys = DECISIONS[name].keys
    if keys is None:
        raise ValueError(f"prune.decision={name} ranks no keys: it prunes below its threshold (methods.original_decision)")
    return keys(probe, threshold, reduction)
