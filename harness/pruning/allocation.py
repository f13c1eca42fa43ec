"""Per-layer sparsity allocation: how much of each matrix to prune for a model-wide target.

Uniform (the default) prunes every matrix to the target, and `select` needs no per-matrix
sparsities. A non-uniform allocation (OWL, measured worse here and kept in
`harness.pruning.experimental.owl`) is a name -> sparsity map, turned into `select`'s
per-layout sparsities by `view_sparsities`.
"""

from __future__ import annotations

from harness.pruning.shards import ShardView


def view_sparsities(views: list[ShardView], allocation: dict[str, float] | None, pool: float = 0.0) -> list[float] | None:
    """`select`'s per-layout sparsities for these views (None: the rule's own, uniform);
    `pool` widens them as exact-target GradProbe widens its candidate rule."""
    if not allocation:
        return None
    return [min(1.0, allocation[v.name] * (1.0 + pool)) for v in views]
