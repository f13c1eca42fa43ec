"""Which part of a parameter this rank stores, however the engine shards it.

Every engine's storage is described the same way: the full tensor's shape, the flat range
``[start, end)`` of its row-major elements that this rank holds, and a writable 1-D view of
them. FSDP2 (`fully_shard`) holds whole rows of dim 0 (a DTensor's local shard), DeepSpeed
ZeRO-3 a flat partition cut anywhere (`ds_tensor`, padded on the last rank), everything else
the whole tensor. Loading reads exactly that range from a checkpoint or an init.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from harness.models import Part, whole_part


def _dtensor_part(p: DTensor) -> Part:
    mesh = p.device_mesh
    (placement,) = p.placements
    if mesh.ndim != 1 or not (isinstance(placement, Shard) and placement.dim == 0):
        raise NotImplementedError(f"FSDP2 placement {p.placements} on mesh {tuple(mesh.shape)}: only Shard(0) on a 1-D mesh")
    rows = p.shape[0]
    per_rank = -(-rows // mesh.size())  # torch.chunk's split: ceil(rows / world), the last ranks short or empty
    local = p.to_local()
    r0 = min(mesh.get_local_rank() * per_rank, rows)
    row = p.numel() // rows if rows else 0
    return tuple(p.shape), r0 * row, (r0 + local.shape[0]) * row, local.view(-1)


def _zero3_part(p: torch.Tensor) -> Part:
    group = getattr(p, "ds_process_group", None)
    per_rank = p.ds_tensor.ds_numel
    start = min(dist.get_rank(group) * per_rank, p.ds_numel)
    end = min(start + per_rank, p.ds_numel)
    return tuple(p.ds_shape), start, end, p.ds_tensor.data.view(-1)[: end - start]


def local_part(p: torch.Tensor) -> Part:
    """(full shape, flat start, flat end, writable view of this rank's elements)."""
    if isinstance(p, DTensor):
        return _dtensor_part(p)
    if hasattr(p, "ds_tensor"):
        return _zero3_part(p)
    return whole_part(p)
