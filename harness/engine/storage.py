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
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from harness.models import Part, whole_part


def _dtensor_part(p: DTensor) -> Part:
    """Whole rows of dim 0: FSDP2's `Shard(0)` over the world, or an expert range's rows split over
    its replicas (the experts' `Shard(0)` on the expert mesh under FSDP2's on the replica mesh)."""
    if not all(isinstance(pl, (Shard, _StridedShard)) and pl.dim == 0 for pl in p.placements):
        raise NotImplementedError(f"placement {p.placements} on mesh {tuple(p.device_mesh.shape)}: only dim-0 shards")
    local = p.to_local()
    rows = p.shape[0]
    row = p.numel() // rows if rows else 0
    if p.device_mesh.ndim == 1:
        per_rank = -(-rows // p.device_mesh.size())  # torch.chunk's split: ceil(rows / world), the last ranks short or empty
        r0 = min(p.device_mesh.get_local_rank() * per_rank, rows)
    else:
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        r0 = offset[0] if local.numel() else rows
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
