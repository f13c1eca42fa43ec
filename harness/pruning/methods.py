"""The pruning rules: magnitude, Wanda, SparseGPT and GradProbe's decision, on local shards.

Each function takes this rank's piece of each matrix (a ShardView and its statistics) and
returns this rank's piece of the mask (True = pruned). Anything that needs more than the
local piece goes through `select` (counts only) or `layout.exchange_split_units` (the at
most two rows per rank that a ZeRO partition boundary cuts, for SparseGPT's row update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.config.schema import PRUNE_BASES
from harness.distributed import Collectives
from harness.pruning.layout import Layout, exchange_split_units
from harness.pruning.select import (
    FLOAT_KEY_BITS,
    _bits,
    count_for,
    float_keys,
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


def make_rule(method: str, base: str, pattern: tuple[int, int] | None, sparsity: float, scope: str) -> Rule:
    """The selection shape a method uses. Wanda (and GradProbe on a Wanda base) compares
    within output rows, by Wanda's definition; a global scope is refused for them rather
    than silently ignored."""
    if pattern is not None:
        n, m = pattern
        if abs(sparsity - (m - n) / m) > 1e-9:
            raise ValueError(f"pattern {n}:{m} prunes {(m - n) / m:g} of the weights; set sparsity={(m - n) / m:g} (got {sparsity:g})")
        return Rule("nm", sparsity, n, m)
    per_row = method == "wanda" or (method == "gradprobe" and base in PER_ROW_BASES)
    if per_row:
        if scope == "global":
            raise ValueError(
                f"{base if method == 'gradprobe' else method} compares weights within an output row; "
                "scope=global does not apply (use per_matrix)"
            )
        return Rule("per_row", sparsity)
    return Rule(scope, sparsity)


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


# Base scores GradProbe can draw its candidates from (PRUNE_BASES). All but magnitude compare weights
# within an output row, as Wanda does; gblm and taylor need the gradient statistics the
# probe's first pass collects anyway (sum over probe steps of the squared gradient).
PER_ROW_BASES = tuple(b for b in PRUNE_BASES if b != "magnitude")
GRADIENT_BASES = ("gblm", "taylor")
INPUT_NORM_BASES = ("wanda", "gblm", "ria")


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    return weight.abs()


def wanda_scores(weight: torch.Tensor, layout: Layout, norms: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2 for this rank's flat range (column j = flat index mod cols)."""
    cols = _local_columns(layout, weight.device)
    return (weight.double().abs() * norms.to(weight.device)[cols]).float()


def _local_columns(layout: Layout, device: torch.device) -> torch.Tensor:
    return torch.arange(layout.start, layout.end, device=device) % layout.cols


def _local_rows(layout: Layout, device: torch.device) -> torch.Tensor:
    return torch.arange(layout.start, layout.end, device=device) // layout.cols


def taylor_scores(weight: torch.Tensor, grad_sumsq: torch.Tensor) -> torch.Tensor:
    """|W_ij| * sqrt(sum_t g_t,ij^2): the square root of the Fisher (OBD) estimate of the loss
    increase from removing W_ij, w^2 E[g^2] / 2, with the expectation over probe steps. The
    mean gradient of a trained model is near zero, so the first-order |W g| of one averaged
    gradient is mostly noise; the squared per-step gradients are not."""
    return (weight.double().abs() * grad_sumsq.to(weight.device).double().sqrt()).float()


def gblm_scores(weight: torch.Tensor, layout: Layout, norms: torch.Tensor, grad_sumsq: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """GBLM-Pruner's |W|*||X_j|| + alpha*|W|*||G_ij||_2. The paper fixes alpha for its gradient
    scale (per-sample gradients of a mean loss); ours are per probe step, so the gradient term
    is rescaled per matrix to the mean of the Wanda term (alpha = 1 after that): neither term
    dominates by an accident of units. The means are over the whole matrix (one all-reduce)."""
    wanda = wanda_scores(weight, layout, norms).double()
    grad = taylor_scores(weight, grad_sumsq).double()
    sums = comm.all_reduce_sum(torch.stack([wanda.sum(), grad.sum()]))
    # Rounded to fp32: partial sums added in another order at another world size differ in
    # the last fp64 bits, and the masks must not.
    scale = float(torch.tensor(float(sums[0] / sums[1]), dtype=torch.float32)) if float(sums[1]) > 0 else 0.0
    return (wanda + scale * grad).float()


def ria_scores(weight: torch.Tensor, layout: Layout, norms: torch.Tensor, comm: Collectives, power: float = 0.5) -> torch.Tensor:
    """RIA (relative importance and activations): (|W_ij| / sum_k |W_ik| + |W_ij| / sum_k |W_kj|) * ||X_j||^0.5.
    Row and column sums cover the whole matrix: each rank adds its elements' |W| into
    rows+cols sized vectors, then one all-reduce (rows cut by a shard boundary included)."""
    dev = weight.device
    a = weight.double().abs()
    rows, cols = _local_rows(layout, dev), _local_columns(layout, dev)
    sums = torch.zeros(layout.rows + layout.cols, dtype=torch.float64, device=dev)
    sums.index_add_(0, rows, a)
    sums.index_add_(0, layout.rows + cols, a)
    sums = comm.all_reduce_sum(sums).float().double()  # fp32: the same sums whatever order the ranks added them in
    row_sum, col_sum = sums[: layout.rows], sums[layout.rows :]
    relative = a / torch.where(row_sum[rows] > 0, row_sum[rows], 1.0) + a / torch.where(col_sum[cols] > 0, col_sum[cols], 1.0)
    return (relative * norms.to(dev)[cols].pow(power)).float()


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


def _within_pool(keys: torch.Tensor, pool: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
    """Decision keys confined to the pool: non-pool weights EXCLUDED, already-pruned ones first."""
    keys = torch.where(pool, keys, torch.full_like(keys, EXCLUDED))
    if forced is not None:
        keys = torch.where(forced, torch.full_like(keys, FORCED_KEY), keys)
    return keys


def exact_keys(
    pool: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor, base_scores: torch.Tensor, forced: torch.Tensor | None
) -> torch.Tensor:
    """Composite keys ranking the pool by relative gradient increase (lowest pruned first),
    ties by base score then index; non-pool weights are EXCLUDED."""
    # Rounded to bf16 (monotone), so ratios stored in bf16 for a global selection rank the same.
    ratio16 = float_keys(gradient_ratio(g0, g1).to(torch.bfloat16).float()) >> (FLOAT_KEY_BITS - RATIO_BITS)
    keys = (ratio16 << FLOAT_KEY_BITS) | float_keys(base_scores)
    return _within_pool(keys, pool, forced)


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
    return _within_pool(keys, pool, forced)


def saliency_keys(
    pool: torch.Tensor, weight: torch.Tensor, sum0: torch.Tensor, sum1: torch.Tensor, reduction: float, forced: torch.Tensor | None
) -> torch.Tensor:
    """Keys ranking the pool by the loss increase the probe predicts for removing each weight.

    Shrinking the pool by `reduction` moves the weights by d = -(1 - r) w_pool, so the change
    of the calibration gradient is a finite-difference Hessian-vector product:
    g1 - g0 ~= H d, i.e. (H w_pool)_i ~= (g0 - g1)_i / (1 - r). Removing the pool changes the
    loss by -g0.w + w.H.w / 2 to second order; weight i's share of it is
    -g0_i w_i + w_i (g0_i - g1_i) / (2 (1 - r)), with the interactions of everything else
    shrunk at the same time included. `sum0`/`sum1` are the gradients summed over the probe
    steps (the common factor does not change the order). Lowest pruned first."""
    w = weight.double()
    s0, s1 = sum0.to(weight.device).double(), sum1.to(weight.device).double()
    loss = -s0 * w + w * (s0 - s1) / (2.0 * (1.0 - reduction))
    keys = float_keys(loss.float())
    return _within_pool(keys, pool, forced)


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
    first, last = layout.whole_units(C)
    split = {r: t for r, t in exchange_split_units(layout, weight, C, comm).items() if _touches(layout, r * C, (r + 1) * C)}
    split_forced = {}
    if forced is not None:
        split_forced = exchange_split_units(layout, forced, C, comm)
    row_ids = sorted(set(range(first, last)) | set(split))
    nr = len(row_ids)
    W = torch.zeros(nr, C, dtype=torch.float64, device=dev)
    F = torch.zeros(nr, C, dtype=torch.bool, device=dev)
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
    row_index = torch.tensor(row_ids, dtype=torch.int64, device=dev)

    H = H.to(dev, torch.float64).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(C, dtype=H.dtype, device=dev)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

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

    new_local = torch.empty(layout.local_numel, dtype=torch.float32, device=dev)
    new_mask = torch.zeros(layout.local_numel, dtype=torch.bool, device=dev)
    for i, r in enumerate(row_ids):
        sl = layout.local_slice(r * C, (r + 1) * C)
        lo = layout.start + sl.start - r * C
        new_local[sl] = W[i, lo : lo + sl.stop - sl.start].float()
        new_mask[sl] = mask[i, lo : lo + sl.stop - sl.start]
    return new_local, new_mask
