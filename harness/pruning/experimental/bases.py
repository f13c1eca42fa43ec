"""GradProbe base scores measured worse than Wanda on the pruning benchmark: taylor, gblm, ria.

They stay reachable (`prune.base=taylor|gblm|ria`, unchanged) for research, out of the main
path: `harness.pruning.gradprobe` dispatches to `base_scores` here for any base other than
magnitude and wanda. gblm and taylor need the gradient statistics the probe's first pass
collects anyway (sum over probe steps of the squared gradient); gblm and ria need the input
norms Wanda uses. Measurements: notes/pruning.md.
"""

from __future__ import annotations

import torch

from harness.distributed import Collectives
from harness.pruning.layout import Layout
from harness.pruning.methods import local_columns, wanda_scores

GRADIENT_BASES = ("gblm", "taylor")  # need the probe's squared-gradient sums
NORM_BASES = ("gblm", "ria")  # need the input norms (as wanda does)


def _local_rows(layout: Layout, device: torch.device) -> torch.Tensor:
    return torch.arange(layout.start, layout.end, device=device) // layout.cols


def taylor_scores(weight: torch.Tensor, grad_sumsq: torch.Tensor) -> torch.Tensor:
    """|W_ij| * sqrt(sum_t g_t,ij^2): the square root of the Fisher (OBD) estimate of the loss
    increase from removing W_ij, w^2 E[g^2] / 2, with the expectation over probe steps. The
    mean gradient of a trained model is near zero, so the first-order |W g| of one averaged
    gradient is mostly noise; the squared per-step gradients are not."""
    return (weight.double().abs() * grad_sumsq.to(weight.device).double().sqrt()).float()


def gblm_scores(
    weight: torch.Tensor, features: torch.Tensor, norms: torch.Tensor, grad_sumsq: torch.Tensor, comm: Collectives
) -> torch.Tensor:
    """GBLM-Pruner's |W|*||X_j|| + alpha*|W|*||G_ij||_2. The paper fixes alpha for its gradient
    scale (per-sample gradients of a mean loss); ours are per probe step, so the gradient term
    is rescaled per matrix to the mean of the Wanda term (alpha = 1 after that): neither term
    dominates by an accident of units. The means are over the whole matrix (one all-reduce)."""
    wanda = wanda_scores(weight, features, norms).double()
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
    rows, cols = _local_rows(layout, dev), local_columns(layout, dev)
    sums = torch.zeros(layout.rows + layout.cols, dtype=torch.float64, device=dev)
    sums.index_add_(0, rows, a)
    sums.index_add_(0, layout.rows + cols, a)
    sums = comm.all_reduce_sum(sums).float().double()  # fp32: the same sums whatever order the ranks added them in
    row_sum, col_sum = sums[: layout.rows], sums[layout.rows :]
    relative = a / torch.where(row_sum[rows] > 0, row_sum[rows], 1.0) + a / torch.where(col_sum[cols] > 0, col_sum[cols], 1.0)
    return (relative * norms.to(dev)[cols].pow(power)).float()


def base_scores(
    base: str,
    weight: torch.Tensor,
    layout: Layout | None,
    features: torch.Tensor,
    norms: torch.Tensor | None,
    grad_sumsq: torch.Tensor | None,
    comm: Collectives,
) -> torch.Tensor:
    """The experimental `base`'s scores of this rank's piece (lowest pruned first). Collective
    for gblm and ria, which normalise over the whole matrix: every rank calls it per matrix."""
    if base == "taylor":
        assert grad_sumsq is not None
        return taylor_scores(weight, grad_sumsq)
    if base not in NORM_BASES:
        raise ValueError(f"unknown GradProbe base {base!r}")
    assert layout is not None and norms is not None
    if base == "gblm":
        assert grad_sumsq is not None
        return gblm_scores(weight, features, norms, grad_sumsq, comm)
    return ria_scores(weight, layout, norms, comm)
