"""The part of a tensor this rank holds, whatever kind of tensor it is; and the whole of one whose
rows the ranks of a group hold in parts, with its gradient sent back to them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters, gradients, optimizer state); any other tensor itself.

    The one spelling of "the bytes this rank holds": byte counts, finiteness checks and
    per-parameter optimizers must never touch a DTensor's global view (that would gather)."""
    return t.to_local() if isinstance(t, DTensor) else t


class _GatherRows(torch.autograd.Function):
    """`all_gather_into_tensor` along dim 0, its backward the reduce-scatter of the whole's gradient:
    each rank's rows get the sum of every rank's gradient for them (torch's own autograd all-gather
    emulates that on gloo with scatters addressed by global rank, which fails on a subgroup)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        mine = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
        return mine, None


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `x` (the same shape on each), concatenated along dim 0 in rank order, differentiably:
    the backward sums the ranks' gradients of each rank's rows (every rank computing the same loss
    of the whole gives each part the group's size times that loss's gradient)."""
    return _GatherRows.apply(x, group)
