"""Whether the weights every rank holds are finite: one collective over `Engine.local_parameters`
(the checkpoint refuses to save non-finite weights; the step guard stops a run whose update
applied a non-finite gradient)."""

from __future__ import annotations

import torch

from harness.distributed import Collectives
from harness.engine.base import Engine


def weights_finite(engine: Engine, comm: Collectives) -> bool:
    """Whether every rank's weights are finite (collective)."""
    return comm.all(all(bool(torch.isfinite(t).all()) for t in engine.local_parameters()))
