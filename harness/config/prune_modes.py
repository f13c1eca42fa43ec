"""The pruning methods' and GradProbe's decision modes' settings: what each implies, and the
combinations none can run.

`prune.decision` names the rule; `scope`, `stat_dtype`, `exact_target` and `sequential` left
unset (None) take the mode's default, so a run that names `decision: original` gets the
original algorithm without having to spell out its five settings, and a setting the user did
write is never silently replaced: if it contradicts the mode, the run is refused before
launch (`check_prune_mode`, called from `checks.check_prune_config`).

Per mode: candidates; groups; decision; statistics.
- rank: the base rule x (1 + pool) per group; K decoder blocks; exactly the target, ranked by
  G1/G0; bf16.
- veto (the default): as rank, but exactly the target in base order, G1/G0 >
  1 + threshold only vetoes; bf16.
- saliency: as rank, ranked by the loss increase the probe predicts (a Hessian-vector
  product); bf16 max, fp32 sums.
- original: the base rule at the target, once, on the dense model (magnitude: one global
  threshold; Wanda: per row); one matrix at a time in model order, each applied before the
  next; G1 <= G0 (1 + threshold), undershoots; fp32.

The original mode is dcifrian/GradProbe's low-memory streaming pruner: 2 forward+backward
passes per matrix.

Wanda, SparseGPT and sparsegpt_fit are sequential by default, one decoder block at a time on the
pruned blocks' outputs, as their reference code runs them (`harness.pruning.blockwise`); Wanda
with `sequential: false` takes every norm from the dense model in one pass. sparsegpt_fit fits
each block after SparseGPT's step (`fit_epochs`, `fit_lr`): decoder blocks only, sequential.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.config.prune_methods import decision_facts, method_facts, reads_base, row_score, row_score_key
from harness.config.schema import PruneConfig
from harness.errors import ConfigError

# The keys a mode fills when the user left them unset (None; group_size 0 = automatic).
MODE_KEYS = ("scope", "stat_dtype", "exact_target", "sequential", "group_size")
# GradProbe's own keys: candidates, probe, grouping; the other methods read none of them.
GRADPROBE_KEYS = ("base", "pool", "threshold", "reduction", "stat_dtype", "group_size")
# The block fit's keys: read by the methods that fit (`MethodFacts.fits`) only.
FIT_KEYS = ("fit_epochs", "fit_lr")
PRUNE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PruneConfig)}


def is_original(p: PruneConfig) -> bool:
    return reads_base(p) and decision_facts(p).original


def mode_defaults(p: PruneConfig) -> dict[str, Any]:
    """What an unset key means under this config's mode."""
    if is_original(p):
        # The original's magnitude strategy prunes below one threshold over all matrices
        # (torch's global_unstructured); its Wanda strategy compares within rows, for
        # which the scope is not read.
        return {
            "scope": "global" if p.base == "magnitude" else "per_matrix",
            "stat_dtype": "fp32",
            "exact_target": False,
            "sequential": True,
            "group_size": 1,
        }
    # Wanda and SparseGPT run sequentially by default, as their reference code does; GradProbe's
    # other modes measure the model as the stage found it.
    return {
        "scope": "per_matrix",
        "stat_dtype": "bf16",
        "exact_target": True,
        "sequential": method_facts(p).sequential,
        "group_size": p.group_size,
    }


def resolve_prune(p: PruneConfig) -> tuple[PruneConfig, list[str]]:
    """(the config with every unset mode key filled, 'key=value' for each key filled)."""
    defaults = mode_defaults(p)
    filled: dict[str, Any] = {}
    for key in MODE_KEYS:
        unset = getattr(p, key) == 0 if key == "group_size" else getattr(p, key) is None
        if unset and defaults[key] != getattr(p, key):
            filled[key] = defaults[key]
    shown = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in filled.items()]
    return dataclasses.replace(p, **filled), shown


def check_prune_mode(p: PruneConfig) -> None:
    """Refuse (ConfigError, one line) a method or decision mode combined with a setting it cannot
    honour. Checked on the config as written, so an explicit contradiction is named, not overridden."""
    if not p.prunes_weights:
        return
    check_method_keys(p)
    facts = method_facts(p)
    if facts.fits and (p.scope == "global" or p.sequential is False or p.fit_epochs < 0 or p.fit_lr <= 0):
        raise ConfigError(
            f"prune.method={p.method} prunes one decoder block after another, each on the pruned blocks' outputs, "
            "per block of columns or N:M, then fits it: unset prune.scope and prune.sequential; "
            "prune.fit_epochs >= 0, prune.fit_lr > 0"
        )
    if facts.fits and p.targets != "decoder_linears":
        raise ConfigError(
            f"prune.targets={p.targets} with prune.method={p.method}: it fits one decoder block at a time, "
            "so it prunes decoder-block Linears only; unset prune.targets, or use prune.method=sparsegpt"
        )
    by_row = row_score(p)
    if by_row is not None and p.scope == "global":
        raise ConfigError(
            f"prune.scope=global with {row_score_key(p)}={by_row}: "
            f"{by_row} compares weights within an output row; unset prune.scope (or per_matrix)"
        )
    if p.allocation != "uniform":
        if p.pattern != "unstructured" or p.scope == "global":
            clash = f"prune.pattern={p.pattern}" if p.pattern != "unstructured" else "prune.scope=global"
            raise ConfigError(
                f"prune.allocation={p.allocation} with {clash}: "
                "the allocation sets each block's unstructured sparsity; use prune.pattern=unstructured and "
                "prune.scope=per_matrix, or prune.allocation=uniform"
            )
        if not 0.0 < p.owl_lambda < min(p.sparsity, 1.0 - p.sparsity) + 1e-12:
            raise ConfigError(
                f"prune.owl_lambda={p.owl_lambda} must be in (0, {min(p.sparsity, 1.0 - p.sparsity):g}] so every "
                f"block's sparsity stays within [0, 1) around prune.sparsity={p.sparsity}"
            )
        if is_original(p):
            raise ConfigError(
                "prune.allocation=owl with prune.decision=original: the original prunes to one global threshold; unset prune.allocation"
            )
    if decision_facts(p).original:
        check_original(p)
        return
    if not reads_base(p):
        return
    if p.exact_target is False:
        raise ConfigError(
            f"prune.exact_target=false with prune.decision={p.decision}: {p.decision} prunes exactly the target; "
            "the undershooting veto (prune only where the gradient did not grow) is prune.decision=original"
        )
    if decision_facts(p).per_matrix_only and p.scope == "global":
        raise ConfigError(
            f"prune.scope=global with prune.decision={p.decision}: the {p.decision} decision ranks each matrix's "
            "candidates on their own; unset prune.scope (or per_matrix)"
        )
    if p.scope == "global" and p.sequential:
        raise ConfigError(
            f"prune.scope=global with prune.sequential=true and prune.decision={p.decision}: an exact-target "
            "global ranking needs every matrix probed before any is pruned; set prune.sequential=false, "
            "prune.scope=per_matrix, or prune.decision=original (global candidates, applied matrix by matrix)"
        )


def check_method_keys(p: PruneConfig) -> None:
    """Refuse a key the configured method does not read: GradProbe's own keys (`GRADPROBE_KEYS`)
    with another method, the fit's (`FIT_KEYS`) with a method that does not fit; a key counts when
    its value is not the schema's default (a saved full config writes every key). Also called by
    `run_pruning` for library callers."""
    if not p.prunes_weights:
        return
    facts = method_facts(p)
    unread = [] if facts.reads_base else list(GRADPROBE_KEYS)
    if not facts.fits:
        unread += FIT_KEYS
    clash = [k for k in unread if getattr(p, k) != PRUNE_DEFAULTS[k]]
    if not clash:
        return
    names = ", ".join(f"prune.{k}={getattr(p, k)}" for k in clash)
    readers = "prune.method=gradprobe" if clash[0] in GRADPROBE_KEYS else "prune.method=sparsegpt_fit"
    one = len(clash) == 1
    raise ConfigError(
        f"{names} {'is' if one else 'are'} read by {readers} only, not prune.method={p.method}: set {readers} to use "
        f"{'it' if one else 'them'}, or unset " + ", ".join(f"prune.{k}" for k in clash)
    )


def check_original(p: PruneConfig) -> None:
    """The original mode's own contradictions (also checked by `run_pruning`, which library
    callers reach without a run config's checks)."""
    if not reads_base(p):
        raise ConfigError(
            f"prune.decision=original is GradProbe's rule; prune.method={p.method} has no gradient veto: set "
            "prune.method=gradprobe or unset prune.decision"
        )
    why = "prune.decision=original reproduces the original GradProbe"
    if p.base not in ("magnitude", "wanda"):
        raise ConfigError(
            f"prune.base={p.base} with prune.decision=original: {why}, whose candidates come from magnitude "
            "or Wanda; set prune.base=magnitude or wanda"
        )
    if p.pattern != "unstructured":
        raise ConfigError(
            f"prune.pattern={p.pattern} with prune.decision=original: the veto leaves some groups with fewer "
            f"than M-N zeros, which no N:M kernel can store; use prune.decision=rank for N:M"
        )
    if p.exact_target:
        raise ConfigError(
            "prune.exact_target=true with prune.decision=original: the original's veto undershoots the target "
            "by design; unset prune.exact_target, or use prune.decision=rank for an exact target"
        )
    if p.sequential is False:
        raise ConfigError(
            f"prune.sequential=false with prune.decision=original: {why}, which zeroes each matrix's pruned "
            "weights before probing the next; unset prune.sequential"
        )
    if p.group_size not in (0, 1):
        raise ConfigError(
            f"prune.group_size={p.group_size} with prune.decision=original: {why}, which probes one matrix "
            "at a time (2 passes per matrix); unset prune.group_size (or 1)"
        )
    if p.base == "magnitude" and p.scope == "per_matrix":
        raise ConfigError(
            f"prune.scope=per_matrix with prune.decision=original and prune.base=magnitude: {why}, whose "
            "magnitude candidates are below one global threshold; unset prune.scope (or global)"
        )
    if p.stat_dtype is not None and p.stat_dtype != "fp32":
        raise ConfigError(
            f"prune.stat_dtype={p.stat_dtype} with prune.decision=original: {why}, which compares fp32 "
            "gradient statistics; unset prune.stat_dtype (or fp32)"
        )


def check_prune_widths(p: PruneConfig, shape: dict) -> None:
    """An N:M pattern's M must divide every pruned layer's input width (`shape`: the model config's values)."""
    if not p.prunes_weights or p.pattern == "unstructured":
        return
    m = int(p.pattern.split(":")[1])
    heads = shape.get("num_attention_heads")
    widths = {
        "hidden_size": shape.get("hidden_size"),
        "intermediate_size": shape.get("intermediate_size"),
        "num_attention_heads*head_dim": heads * shape["head_dim"] if heads and shape.get("head_dim") else None,
    }
    for what, width in widths.items():
        if width and width % m:
            raise ConfigError(
                f"prune.pattern={p.pattern}: M={m} must divide every pruned layer's input width, "
                f"but {what}={width}; use an M that divides it (e.g. 2:4)"
            )
