"""Which `ParamShard` a parameter gets (`shard_of`), and how an engine's model is stored (`memory_storage`).

The shard classes: `shard_base` (replicated, FSDP2's DTensor) and `deepspeed_shards` (ZeRO).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from harness.distributed import is_deepspeed_engine
from harness.engine.deepspeed_shards import deepspeed_memory_storage, deepspeed_shard_of
from harness.engine.shard_base import DTensorShard, ParamShard
from harness.engine.storage import local_part
from harness.memory import ModelStorage

Split = Callable[[int], tuple[int, int]]  # a replicated parameter's numel -> the flat range this rank works on


def shard_of(param: nn.Parameter, name: str, world: int, split: Split | None = None) -> ParamShard:
    """The shard object of `param` on this rank of a `world`-rank run; `split` picks the range a
    rank works on where every rank holds the whole parameter (default: all of it).

    A DTensor's mesh spans the world (FSDP2's, or the experts' replica x expert under FSDP2: every
    element held by one rank), or, for experts split under DDP with replicas, one expert group: each
    range then held whole by world / mesh ranks, as a replicated parameter is held by every rank."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        if world % mesh.size() or (mesh.size() != world and mesh.ndim != 1):
            raise NotImplementedError(f"DTensor mesh {tuple(mesh.shape)}: only a mesh over all {world} ranks is supported (no HSDP)")
        shape, start, end, _ = local_part(param)
        return DTensorShard(name, param, shape, start, end)
    deepspeed_shard = deepspeed_shard_of(param, name, world)
    if deepspeed_shard is not None:
        return deepspeed_shard
    shape = tuple(param.shape)
    start, end = split(param.numel()) if split is not None else (0, param.numel())
    return ParamShard(name, param, shape, start, end)


def memory_storage(model_or_engine: Any) -> ModelStorage:
    """How the model a memory tracker follows is stored: an FSDP2 root, a DeepSpeed engine, or a plain module."""
    if isinstance(model_or_engine, FSDPModule):
        return ModelStorage(sharded=True)
    if is_deepspeed_engine(model_or_engine):
        return deepspeed_memory_storage(model_or_engine)
    return ModelStorage()


__all__ = ["DTensorShard", "ParamShard", "Split", "memory_storage", "shard_of"]
