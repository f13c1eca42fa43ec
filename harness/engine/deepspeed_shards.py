"""DeepSpeed's parameter storage as `ParamShard`s: the one place outside the DeepSpeed engine's own
module that reads ZeRO's internals (`ds_tensor`, `_hp_mapping`, `safe_*_local_*`, `ds_status`).

- zero3: ZeRO-3 flat partitions (`ds_tensor`, padded on the last rank), cut anywhere; the fp32
  master and the reduced gradient through DeepSpeed's `safe_get/set_local_*` API;
- zero12: ZeRO-1/2 (and DeepSpeed's bf16 optimizer): whole working weights on every rank, the
  fp32 master and the reduced gradient partitioned into fragments (`_hp_mapping`).

DeepSpeed is imported where it is used: importing it probes accelerators and logs, and runs
that never use DeepSpeed should not pay for that.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.engine.shard_base import ParamShard
from harness.engine.storage import local_part
from harness.memory import ModelStorage


class Zero3Shard(ParamShard):
    """A ZeRO-3 partition; the whole working tensor exists only while DeepSpeed has it gathered."""

    storage = "zero3"
    replicated_working = False

    @property
    def keeps_full_working(self) -> bool:
        return bool(getattr(self.param, "ds_persist", False))  # small parameters DeepSpeed keeps gathered

    def working(self) -> torch.Tensor:
        return self.param.ds_tensor.data.view(-1)[: self.local_numel]

    def master(self) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_local_fp32_param

        return safe_get_local_fp32_param(self.param).view(-1)[: self.local_numel]

    def grad(self) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_local_grad

        g = safe_get_local_grad(self.param)
        return None if g is None else g.reshape(-1)[: self.local_numel]

    def full_working(self) -> torch.Tensor | None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return self.param.data if self.param.ds_status == ZeroParamStatus.AVAILABLE else None

    def _write_master(self, mask: torch.Tensor | slice, values: torch.Tensor | float) -> None:
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

        full = safe_get_local_fp32_param(self.param).clone()
        part = full.view(-1)[: self.local_numel]
        part[mask] = values.float() if torch.is_tensor(values) else values
        safe_set_local_fp32_param(self.param, full)


class Zero12Shard(ParamShard):
    """ZeRO-1/2: the working weights whole on every rank; this rank's range is its master fragment."""

    storage = "zero12"
    replicated_working = True

    def master(self) -> torch.Tensor | None:
        mapping = self.param._hp_mapping
        return None if mapping is None else mapping.get_hp_fragment().data.view(-1)

    def grad(self) -> torch.Tensor | None:
        p = self.param
        if p._hp_mapping is None:
            return None
        g = p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
        if g.numel() == self.numel and self.numel != self.local_numel:
            g = g[self.start : self.end]  # the bf16 optimizer keeps a full accumulation buffer
        return g

    def _write_master(self, mask: torch.Tensor | slice, values: torch.Tensor | float) -> None:
        if self.param._hp_mapping is not None:
            hp = self.param._hp_mapping.get_hp_fragment().data.view(-1)
            hp[mask] = values.to(hp.dtype) if torch.is_tensor(values) else values


def deepspeed_shard_of(param: nn.Parameter, name: str, world: int) -> ParamShard | None:
    """The ZeRO shard of `param`, or None where DeepSpeed does not manage it."""
    if hasattr(param, "ds_id"):
        if dist.get_world_size(getattr(param, "ds_process_group", None)) != world:
            raise NotImplementedError("ZeRO-3 partition groups smaller than the world (MiCS/hpZ) are not supported")
        shape, start, end, _ = local_part(param)
        return Zero3Shard(name, param, shape, start, end)
    if hasattr(param, "_hp_mapping"):
        mapping = param._hp_mapping
        if mapping is None:
            return Zero12Shard(name, param, tuple(param.shape), 0, 0)
        a = mapping.lp_fragment_address.start
        return Zero12Shard(name, param, tuple(param.shape), a, a + mapping.lp_fragment_address.numel)
    return None


def deepspeed_memory_storage(ds_engine: Any) -> ModelStorage:
    """Where a DeepSpeed engine keeps what the memory trackers cannot see on its module: ZeRO-3's
    parameter partitions (`ds_tensor`) and the ZeRO optimizer's fp32 master partitions (ZeRO-1/2
    `single_partition_of_fp32_groups`, ZeRO-3 `fp32_partitioned_groups_flat`; ZeRO-3 empties
    the inner optimizer's param_groups outside step())."""
    module, optimizer = ds_engine.module, ds_engine.optimizer

    def partitions() -> list[torch.Tensor]:
        return [p.ds_tensor for p in module.parameters() if isinstance(getattr(p, "ds_tensor", None), torch.Tensor)]

    def masters() -> list[torch.Tensor]:
        attrs = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
        return [t for attr in attrs for t in getattr(optimizer, attr, None) or [] if isinstance(t, torch.Tensor)]

    return ModelStorage(partitions=partitions, masters=masters)
