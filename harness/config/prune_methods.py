"""What each pruning method is, as the config, pre-flight and the pipeline need to know it
before anything runs: one table, read wherever a rule depends on the method.

The pipeline's registry (`harness.pruning.registry`) pairs each entry with the code that runs
it, so a new method is one row here, one entry there and its own module; nothing else
compares method names. `prune.method=none` has no row: `PruneConfig.enabled` says whether a
run prunes at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.config.schema import PruneConfig
from harness.config.vocabulary import PRUNE_BASES


@dataclass(frozen=True)
class MethodFacts:
    """One method's facts (what it reads, how it must run), never how it computes."""

    needs_calibration: bool  # reads calibration batches (input statistics or gradients)
    sequential: bool  # the default of an unset prune.sequential: each group applied before the next is measured
    rewrites_weights: bool = False  # updates the weights it keeps (SparseGPT's OBS): sequential only, masks never without weights
    per_row: bool = False  # its score compares weights within an output row (Wanda's definition)
    reads_base: bool = False  # candidates and order come from prune.base, decided by prune.decision (GradProbe)
    fits: bool = False  # fits each block's surviving weights after its masks (prune.fit_epochs, prune.fit_lr): decoder blocks only


PRUNE_METHOD_FACTS: dict[str, MethodFacts] = {
    "magnitude": MethodFacts(needs_calibration=False, sequential=False),
    "wanda": MethodFacts(needs_calibration=True, sequential=True, per_row=True),
    "sparsegpt": MethodFacts(needs_calibration=True, sequential=True, rewrites_weights=True),
    "sparsegpt_fit": MethodFacts(needs_calibration=True, sequential=True, rewrites_weights=True, fits=True),
    "gradprobe": MethodFacts(needs_calibration=True, sequential=False, reads_base=True),
}

# GradProbe's base scores that compare within an output row, as Wanda does: all but magnitude.
PER_ROW_BASES = tuple(b for b in PRUNE_BASES if b != "magnitude")


@dataclass(frozen=True)
class DecisionFacts:
    """One GradProbe decision's facts (`prune.decision`): what the config checks read; the keys each
    computes are its entry in `harness.pruning.decisions`."""

    exact: bool = True  # prunes exactly the target (False: the original's veto, which undershoots by design)
    per_matrix_only: bool = False  # ranks each matrix's candidates on their own: prune.scope=global refused
    probes_sums: bool = False  # reads the probe passes' gradient sums besides their maxima (a Hessian-vector product)
    original: bool = False  # the original GradProbe streaming pruner: its own defaults and refusals (`check_original`)


DECISION_FACTS: dict[str, DecisionFacts] = {
    "veto": DecisionFacts(),
    "rank": DecisionFacts(),
    "saliency": DecisionFacts(per_matrix_only=True, probes_sums=True),
    "original": DecisionFacts(exact=False, original=True),
}


def decision_facts(p: PruneConfig) -> DecisionFacts:
    """The facts of `p.decision` (every name of the schema's vocabulary has a row)."""
    return DECISION_FACTS[p.decision]


def method_facts(p: PruneConfig) -> MethodFacts:
    """The facts of `p.method` (ValueError for `none` or a name with no row)."""
    facts = PRUNE_METHOD_FACTS.get(p.method)
    if facts is None:
        raise ValueError(f"prune.method={p.method!r} names no pruning method (one of {', '.join(PRUNE_METHOD_FACTS)})")
    return facts


def row_score(p: PruneConfig) -> str | None:
    """The score that decides within output rows for this config (`prune.method`, or GradProbe's
    `prune.base`), or None where the selection may span a whole matrix or the model."""
    facts = method_facts(p)
    if facts.reads_base:
        return p.base if p.base in PER_ROW_BASES else None
    return p.method if facts.per_row else None


def row_score_key(p: PruneConfig) -> str:
    """The config key naming `row_score(p)`: what a refusal tells the user to change."""
    return "prune.base" if method_facts(p).reads_base else "prune.method"


def reads_base(p: PruneConfig) -> bool:
    """Whether the config's method draws its candidates from `prune.base` and decides by
    `prune.decision` (GradProbe); False for `prune.method=none`."""
    return p.prunes_weights and method_facts(p).reads_base


def needs_calibration(p: PruneConfig) -> bool:
    """Whether the run draws calibration samples (a method that reads no data draws none; expert
    pruning reads the routing of every rule's)."""
    return p.experts > 0 or (p.prunes_weights and method_facts(p).needs_calibration)
