"""GradProbe decisions measured worse than the veto on the pruning benchmark: rank and saliency.

rank (`exact_keys`) orders the candidate pool by the relative gradient increase G1/G0;
saliency (`saliency_keys`) by the loss increase the probe predicts. Both stay reachable
(`prune.decision=rank|saliency`, unchanged) for research; the main path is the veto
(`harness.pruning.methods.veto_keys`) and the original rule. Measurements: notes/pruning.md.
"""

from __future__ import annotations

import torch

from harness.pruning.methods import RATIO_BITS, gradient_ratio, within_pool
from harness.pruning.select import FLOAT_KEY_BITS, float_keys


def exact_keys(
    pool: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor, base_scores: torch.Tensor, forced: torch.Tensor | None
) -> torch.Tensor:
    """Composite keys ranking the pool by relative gradient increase (lowest pruned first),
    ties by base score then index; non-pool weights are EXCLUDED."""
    # Rounded to bf16 (monotone), so ratios stored in bf16 for a global selection rank the same.
    ratio16 = float_keys(gradient_ratio(g0, g1).to(torch.bfloat16).float()) >> (FLOAT_KEY_BITS - RATIO_BITS)
    keys = (ratio16 << FLOAT_KEY_BITS) | float_keys(base_scores)
    return within_pool(keys, pool, forced)


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
    return within_pool(keys, pool, forced)
