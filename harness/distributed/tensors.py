"""The part of a tensor this rank holds, whatever kind of tensor it is."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters, gradients, optimizer state); any other tensor itself.

    The one spelling of "the bytes this rank holds": byte counts, finiteness checks and
    per-parameter optimizers must never touch a DTensor's global view (that would gather)."""
    return t.to_local() if isinstance(t, DTensor) else t
