"""Whether the weights every rank holds are finite: one collective over `Engine.local_parameters`
(the checkpoint refuses to save non-finite weights; the step guard stops a run whose update
applied a non-finite gradient)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.distributed import DistInfo
from harness.engine.base import Engine


def _all_true(flag: bool, info: DistInfo) -> bool:
    if not info.distributed or info.world_size == 1:
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int32, device=info.device if info.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) == 0


def weights_finite(engine: Engine, info: DistInfo) -> bool:
    """Whether every rank's weights are finite (collective)."""
    local = all(bool(torch.isfinite(t).all()) for t in engine.local_parameters())
    return _all_true(local, info)
