"""GradProbe variants measured worse than the defaults on the pruning benchmark (notes/pruning.md):
research surface, kept reachable from the config exactly as before, out of the main path.

- bases taylor, gblm, ria (`prune.base`): `bases`
- decisions rank and saliency (`prune.decision`): `decisions`
- the OWL allocation (`prune.allocation=owl`): `owl`

The main path (`harness.pruning.gradprobe`, `harness.pruning.pipeline`) imports them from here
only; nothing here is imported by the modules they build on.
"""

from harness.pruning.experimental.bases import GRADIENT_BASES, NORM_BASES, base_scores, gblm_scores, ria_scores, taylor_scores
from harness.pruning.experimental.decisions import exact_keys, saliency_keys
from harness.pruning.experimental.owl import owl_sparsities

__all__ = [
    "GRADIENT_BASES",
    "NORM_BASES",
    "base_scores",
    "exact_keys",
    "gblm_scores",
    "owl_sparsities",
    "ria_scores",
    "saliency_keys",
    "taylor_scores",
]
