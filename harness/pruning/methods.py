"""The pruning rules: magnitude, Wanda, SparseGPT and GradProbe's decisions (veto, original), on
local shards. The GradProbe variants measured worse are in `harness.pruning.experimental`.

Each function takes this rank's piece of each matrix (a ShardView and its statistics) and
returns this rank's piece of the mask (True = pruned). Anything that needs more than the
local piece goes through `select` (counts only) or `layout.exchange_split_units` (the at
most two rows per rank that a ZeRO partition boundary cuts, for SparseGPT's row update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.config import PruneConfig, row_score
from harness.distributed import Collectives
from harness.pruning.layout import Layout, exchange_split_units
from harness.pruning.select import (
    FLOAT_KEY_BITS,
    _bits,
    count_for,
    float_keys,
    parse_pattern,
    radix_select,
    select_global,
    select_per_matrix,
    select_per_unit,
    threshold_mask,
)

# GradProbe's exact-target key: relative gradient increase at the precision of the stored
# statistics (bf16 keeps 16 bits of a float32 key), then the base score, then the index.
RATIO_BITS = 16
COMPOSITE_BITS = RATIO_BITS + FLOAT_KEY_BITS  # keys < 2**48
EXCLUDED = 1 << COMPOSITE_BITS  # outside the pool: never selected (selection asserts it)
FORCED_KEY = 0  # already pruned (an earlier round or a loaded mask): selected first


@dataclass(frozen=True)
class Rule:
    """How a selection is shaped: unstructured per matrix / global, per row, or N:M."""

    kind: str  # per_matrix | global | per_row | nm
    sparsity: float
    n: int = 0  # N:M: kept per group
    m: int = 0

    @property
    def prune_per_group(self) -> int:
        return self.m - self.n


def make_rule(cfg: PruneConfig) -> Rule:
    """The selection shape of a resolved config: N:M from `pattern`; per row where the method's
    score compares within output rows (Wanda, GradProbe on a per-row base: `row_score`), by
    that score's definition, a global scope being refused for them rather than silently
    ignored; otherwise the config's scope."""
    assert cfg.scope is not None, "make_rule reads a resolved config (harness.config.resolve_prune)"
    pattern, sparsity = parse_pattern(cfg.pattern), cfg.sparsity
    if pattern is not None:
        n, m = pattern
        if abs(sparsity - (m - n) / m) > 1e-9:
            raise ValueError(f"pattern {n}:{m} prunes {(m - n) / m:g} of the weights; set sparsity={(m - n) / m:g} (got {sparsity:g})")
        return Rule("nm", sparsity, n, m)
    by_row = row_score(cfg)
    if by_row is not None:
        if cfg.scope == "global":
            raise ValueError(f"{by_row} compares weights within an output row; scope=global does not apply (use per_matrix)")
        return Rule("per_row", sparsity)
    return Rule(cfg.scope, sparsity)


def widen(rule: Rule, pool: float) -> Rule:
    """The candidate pool of exact-target GradProbe: `pool` x more prunable weights than the
    target (within each row/group for per-row and N:M), capped at everything."""
    if rule.kind == "nm":
        extra = min(rule.m, rule.prune_per_group + math.ceil(pool * rule.prune_per_group))
        return Rule("nm", rule.sparsity, rule.m - extra, rule.m)
    return Rule(rule.kind, min(1.0, rule.sparsity * (1.0 + pool)), rule.n, rule.m)


def select(
    rule: Rule, layouts: list[Layout], keys: list[torch.Tensor], comm: Collectives, key_bits: int, sparsities: list[float] | None = None
) -> list[torch.Tensor]:
    """Apply a rule to int64 keys (lowest pruned first); returns local boolean masks.
    `sparsities`: one per layout instead of the rule's (a per-layer allocation such as OWL;
    unstructured per-row / per-matrix rules only)."""
    if sparsities is not None and rule.kind not in ("per_row", "per_matrix"):
        raise ValueError(f"a per-layer sparsity allocation needs unstructured per-matrix selection, not {rule.kind}")
    each = sparsities if sparsities is not None else [rule.sparsity] * len(layouts)
    if rule.kind == "nm":
        return select_per_unit(layouts, keys, [rule.m] * len(layouts), [rule.prune_per_group] * len(layouts), comm, key_bits)
    if rule.kind == "per_row":
        return select_per_unit(
            layouts, keys, [lay.cols for lay in layouts], [count_for(s, lay.cols) for s, lay in zip(each, layouts)], comm, key_bits
        )
    if rule.kind == "per_matrix":
        return select_per_matrix(layouts, keys, [count_for(s, lay.numel) for s, lay in zip(each, layouts)], comm, key_bits)
    if rule.kind == "global":
        return select_global(layouts, keys, count_for(rule.sparsity, sum(lay.numel for lay in layouts)), comm, key_bits)
    raise ValueError(f"unknown selection {rule.kind}")


# Base scores GradProbe can draw its candidates from (PRUNE_BASES; those that compare within an
# output row: PER_ROW_BASES). magnitude and wanda are here; the bases measured worse
# (taylor, gblm, ria) are in harness.pruning.experimental.bases.


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    return weight.abs()


def wanda_scores(weight: torch.Tensor, features: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2 for this rank's flat range; `features[k]`: weight k's input feature,
    its index in `norms` (`ShardView.features`: a Linear's column, an expert's own input)."""
    return (weight.double().abs() * norms.to(weight.device)[features]).float()


def local_columns(layout: Layout, device: torch.device) -> torch.Tensor:
    return torch.arange(layout.start, layout.end, device=device) % layout.cols


def score_keys(scores: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
    """Float keys with already-pruned weights forced to the front."""
    keys = float_keys(scores)
    if forced is not None:
        keys = torch.where(forced, torch.zeros_like(keys), keys)
    return keys


# ------------------------------------------------------------------------------ GradProbe


def gradient_ratio(g0: torch.Tensor, g1: torch.Tensor) -> torch.Tensor:
    """G1/G0, the relative gradient change caused by shrinking the candidates; 0/0 is 1
    (no change) and x/0 is +inf (a gradient appeared where there was none)."""
    a, b = g1.float(), g0.float()
    ratio = a / torch.where(b > 0, b, torch.ones_like(b))
    return torch.where(b > 0, ratio, torch.where(a > 0, torch.full_like(a, math.inf), torch.ones_like(a)))


def original_decision(
    candidates: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor, threshold: float, forced: torch.Tensor | None
) -> torch.Tensor:
    """The reference rule: prune a candidate only if its gradient did not grow beyond
    (1 + threshold) x its original value. Achieved sparsity may fall short of the target."""
    keep_ok = g1.float() <= g0.float() * (1.0 + threshold)
    mask = candidates & keep_ok
    return mask | forced if forced is not None else mask


def within_pool(keys: torch.Tensor, pool: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
    """Decision keys confined to the pool: non-pool weights EXCLUDED, already-pruned ones first."""
    keys = torch.where(pool, keys, torch.full_like(keys, EXCLUDED))
    if forced is not None:
        keys = torch.where(forced, torch.full_like(keys, FORCED_KEY), keys)
    return keys


def veto_keys(
    pool: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor, base_scores: torch.Tensor, threshold: float, forced: torch.Tensor | None
) -> torch.Tensor:
    """Keys that keep the base order and let the gradient only veto: within the pool, every
    weight whose gradient grew beyond (1 + threshold) x (G1/G0, as the original's rule) goes
    behind every weight that passed, each side ordered by base score then index. The target
    count is then filled from the passing weights in base order, and from the vetoed ones
    (again in base order) only if too few passed."""
    vetoed = (gradient_ratio(g0, g1) > 1.0 + threshold).to(torch.int64)
    keys = (vetoed << FLOAT_KEY_BITS) | float_keys(base_scores)
    return within_pool(keys, pool, forced)


# ------------------------------------------------------------------------------ SparseGPT


def _touches(layout: Layout, a: int, b: int) -> bool:
    sl = layout.local_slice(a, b)
    return sl.stop > sl.start


def sparsegpt_prune(
    layout: Layout,
    weight: torch.Tensor,
    H: torch.Tensor,
    rule: Rule,
    comm: Collectives,
    forced: torch.Tensor | None = None,
    blocksize: int = 128,
    damp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT (OBS with a shared inverse Hessian) on this rank's rows.

    Returns (new local weights fp32, local mask). Rows are independent given H, so each
    rank updates the rows it holds; a row cut by a ZeRO boundary is reassembled on the
    ranks holding it (the only weights ever exchanged: at most two rows per rank) and
    computed identically by each of them. The unstructured rule prunes, in every block of
    `blocksize` columns, the lowest w^2/[H^-1]_jj^2 across *all rows of the matrix*: that
    is one distributed selection per block, to which each row's holder of its first element
    contributes. Arithmetic is fp64 so redundant copies of a row agree.
    """
    if rule.kind not in ("per_matrix", "nm"):
        raise ValueError(f"SparseGPT selects per block (unstructured) or N:M, not {rule.kind}")
    C = layout.cols
    dev = weight.device
    row_ids, W, F, counts_here = _rows_held(layout, weight, forced, comm)
    nr = len(row_ids)
    row_index = torch.tensor(row_ids, dtype=torch.int64, device=dev)
    U = _inverse_hessian_factor(H, damp, dev)

    mask = torch.zeros(nr, C, dtype=torch.bool, device=dev)
    index_bits = _bits(layout.numel)
    for i1 in range(0, C, blocksize):
        i2 = min(i1 + blocksize, C)
        W1 = W[:, i1:i2].clone()
        U1 = U[i1:i2, i1:i2]
        Q1 = torch.zeros_like(W1)
        E1 = torch.zeros_like(W1)
        M1 = torch.zeros_like(W1, dtype=torch.bool)
        if rule.kind == "per_matrix":
            scores = (W1 * W1 / torch.diag(U1).reshape(1, -1) ** 2).float()
            keys = score_keys(scores, F[:, i1:i2])
            idx = row_index.reshape(-1, 1) * C + torch.arange(i1, i2, device=dev).reshape(1, -1)
            own = counts_here.reshape(-1, 1).expand_as(keys)
            k = count_for(rule.sparsity, layout.rows * (i2 - i1))
            (t,) = radix_select([[(keys[own], idx[own])]], [k], comm, FLOAT_KEY_BITS, index_bits)
            M1 = threshold_mask(keys, idx, t)
        for i in range(i2 - i1):
            if rule.kind == "nm" and i % rule.m == 0:
                group = (W1[:, i : i + rule.m] ** 2 / torch.diag(U1)[i : i + rule.m].reshape(1, -1) ** 2).float()
                gkeys = score_keys(group, F[:, i1 + i : i1 + i + rule.m])
                order = torch.sort(gkeys, dim=1, stable=True).indices[:, : rule.prune_per_group]
                M1[:, i : i + rule.m].scatter_(1, order, True)
            w = W1[:, i]
            q = torch.where(M1[:, i], torch.zeros_like(w), w)
            err = (w - q) / U1[i, i]
            W1[:, i:] -= err.reshape(-1, 1) * U1[i, i:].reshape(1, -1)
            Q1[:, i] = q
            E1[:, i] = err
        W[:, i1:i2] = Q1
        mask[:, i1:i2] = M1
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return _to_local_range(layout, row_ids, W, mask)


def _rows_held(
    layout: Layout, weight: torch.Tensor, forced: torch.Tensor | None, comm: Collectives
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole rows this rank updates, fp64 (rows a ZeRO boundary cuts reassembled from their
    holders), their forced masks, and which of them this rank counts in a selection (the
    holder of the row's first element)."""
    C, dev = layout.cols, weight.device
    first, last = layout.whole_units(C)
    split = {r: t for r, t in exchange_split_units(layout, weight, C, comm).items() if _touches(layout, r * C, (r + 1) * C)}
    split_forced = {}
    if forced is not None:
        split_forced = exchange_split_units(layout, forced, C, comm)
    row_ids = sorted(set(range(first, last)) | set(split))
    W = torch.zeros(len(row_ids), C, dtype=torch.float64, device=dev)
    F = torch.zeros(len(row_ids), C, dtype=torch.bool, device=dev)
    for i, r in enumerate(row_ids):
        if r in split:
            W[i] = split[r].double()
            if forced is not None:
                F[i] = split_forced[r]
        else:
            sl = layout.local_slice(r * C, (r + 1) * C)
            W[i] = weight[sl].double()
            if forced is not None:
                F[i] = forced[sl]
    counts_here = torch.tensor([r not in split or layout.owner_of(r * C) == comm.rank for r in row_ids], dtype=torch.bool, device=dev)
    return row_ids, W, F, counts_here


def _inverse_hessian_factor(H: torch.Tensor, damp: float, device: torch.device) -> torch.Tensor:
    """The upper Cholesky factor of the damped H^-1 (fp64); dead inputs (zero diagonal) get 1."""
    H = H.to(device, torch.float64).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(H.shape[0], dtype=H.dtype, device=device)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


def _to_local_range(layout: Layout, row_ids: list[int], W: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's flat range of the updated rows and their mask (fp32 weights, bool)."""
    C, dev = layout.cols, W.device
    new_local = torch.empty(layout.local_numel, dtype=torch.float32, device=dev)
    new_mask = torch.zeros(layout.local_numel, dtype=torch.bool, device=dev)
    for i, r in enumerate(row_ids):
        sl = layout.local_slice(r * C, (r + 1) * C)
        lo = layout.start + sl.start - r * C
        new_local[sl] = W[i, lo : lo + sl.stop - sl.start].float()
        new_mask[sl] = mask[i, lo : lo + sl.stop - sl.start]
    return new_local, new_mask
