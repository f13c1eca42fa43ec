"""OWL per-block sparsity allocation (`prune.allocation=owl`), measured worse than uniform here.

OWL (Yin et al., "Outlier Weighed Layerwise sparsity", 2023) prunes blocks with many outlier
activations less: a block's outlier ratio is the share of its Wanda scores |W_ij| * ||X_j||
above `m` x their mean over the block; ratios are scaled to [0, 2 lambda] and centred, and
block l gets sparsity target - (scaled_l - mean). Blocks of equal size keep the model-wide
target exactly (up to each matrix's integer count). The statistics are the dense model's,
from one forward pass. Kept reachable for research; measurements: notes/pruning.md.
"""

from __future__ import annotations

import torch

from harness.distributed import Collectives
from harness.pruning.calibration import InputStats
from harness.pruning.methods import wanda_scores
from harness.pruning.shards import ShardView


def owl_sparsities(views: list[ShardView], stats: InputStats, target: float, lam: float, m: float, comm: Collectives) -> dict[str, float]:
    """Sparsity per view (the same for every matrix of a block). Collective: two all-reduces."""
    units = sorted({v.target.unit for v in views})
    index = {u: i for i, u in enumerate(units)}
    sums = torch.zeros(2 * len(units), dtype=torch.float64)  # per unit: sum of scores, element count
    scores = {}
    for v in views:
        assert v.layout is not None
        scores[v.name] = wanda_scores(v.weight(), v.features(v.lp().device), stats.norms(v.name)).double().cpu()
        sums[2 * index[v.target.unit]] += scores[v.name].sum()
        sums[2 * index[v.target.unit] + 1] += scores[v.name].numel()
    # fp32 rounding: the same means whatever order the ranks' partial sums were added in
    sums = comm.all_reduce_sum(sums).float().double()
    mean = sums[0::2] / sums[1::2].clamp(min=1)
    outliers = torch.zeros(len(units), dtype=torch.float64)
    for v in views:
        i = index[v.target.unit]
        outliers[i] += float((scores[v.name] > m * mean[i]).sum())
    ratio = comm.all_reduce_sum(outliers) / sums[1::2].clamp(min=1)
    spread = float(ratio.max() - ratio.min())
    if spread == 0.0:
        return {v.name: target for v in views}
    scaled = (ratio - ratio.min()) / spread * (2 * lam)
    sparsity = target - (scaled - scaled.mean())
    if float(sparsity.max()) >= 1.0 or float(sparsity.min()) < 0.0:
        raise ValueError(f"OWL with lambda={lam} moves some block's sparsity outside [0, 1) around target {target}; lower prune.owl_lambda")
    return {v.name: float(sparsity[index[v.target.unit]]) for v in views}
