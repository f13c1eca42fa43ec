"""A uniform view of each target Linear's local weight shard and gradient shard.

The pruning algorithms are written once against `ShardView`: "this rank holds the flat
range [start, end) of the row-major weight; here are those weights (and the fp32 master
copy, if the engine keeps one), and here is the gradient of that range, already reduced
across ranks". Four storage schemes hide behind it:

- replicated: a plain module (world 1) or DDP; every rank has the full weight, so ranks
  *share the scoring* by splitting each matrix evenly, as ZeRO would, and an all-gather
  of the changed ranges keeps the replicas identical;
- dtensor: FSDP2 `fully_shard`, Shard(0) rows, `to_local()`;
- zero3: DeepSpeed ZeRO-3 flat partitions (`ds_tensor`, `safe_*_local_*`), cut anywhere;
- zero12: DeepSpeed ZeRO-1/2 (and its bf16 optimizer): full working weights on every rank,
  the fp32 master and the reduced gradient partitioned into fragments (`_hp_mapping`).

No view ever materialises another rank's weights or gradients.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from harness.distributed import Collectives
from harness.engine import local_part
from harness.models import decoder_blocks
from harness.pruning.layout import Layout, even_ranges, gather_ranges


@dataclass
class Target:
    name: str  # qualified name under the unwrapped model, identical for every strategy
    module: nn.Linear
    unit: int  # decoder block index (non-block linears: one extra unit after the last block)


def unwrap(model_or_engine: Any) -> nn.Module:
    """The user's nn.Module inside a DeepSpeed engine or DDP wrapper (FSDP2 wraps in place)."""
    if is_deepspeed_engine(model_or_engine):
        return model_or_engine.module
    if isinstance(model_or_engine, nn.parallel.DistributedDataParallel):
        return model_or_engine.module
    return model_or_engine


def is_deepspeed_engine(obj: Any) -> bool:
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed import DeepSpeedEngine

    return isinstance(obj, DeepSpeedEngine)


def find_targets(module: nn.Module, targets: str) -> list[Target]:
    """The Linear layers to prune: those inside decoder blocks, or every Linear.

    Embeddings are never targets (they are not Linear). A Linear whose weight is shared
    with another module (a tied LM head) is refused rather than silently pruning the
    embedding through it.
    """
    if targets not in ("decoder_linears", "all_linears"):
        raise ValueError(f"targets={targets!r}: expected decoder_linears or all_linears")
    blocks = decoder_blocks(module)
    unit_of = {id(b): i for i, b in enumerate(blocks)}
    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    out: list[Target] = []
    block_prefixes = {}
    for name, m in module.named_modules():
        if id(m) in unit_of:
            block_prefixes[name + "."] = unit_of[id(m)]
    for name, m in module.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        unit = next((u for prefix, u in block_prefixes.items() if name.startswith(prefix)), None)
        if unit is None and targets == "decoder_linears":
            continue
        if owners.get(id(m.weight), 0) > 1:
            raise ValueError(f"{name}.weight is shared with another module (tied weights); prune with targets=decoder_linears")
        out.append(Target(name, m, len(blocks) if unit is None else unit))
    return out


@dataclass
class ShardView:
    """This rank's piece of one target weight; see the module docstring for the kinds."""

    target: Target
    kind: str  # replicated | dtensor | zero3 | zero12
    rows: int
    cols: int
    start: int
    end: int
    layout: Layout | None = None  # set once every rank's range is known

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def param(self) -> nn.Parameter:
        return self.target.module.weight

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def local_numel(self) -> int:
        return self.end - self.start

    @property
    def replicated_lp(self) -> bool:
        """Whether every rank holds the full working weight (writes must be re-gathered)."""
        return self.kind in ("replicated", "zero12")

    # ------------------------------------------------------------------ reading

    @torch.no_grad()
    def lp(self) -> torch.Tensor:
        """A writable 1-D view of the working (forward) weights of this rank's range."""
        p = self.param
        if self.kind == "dtensor":
            return p.to_local().view(-1)
        if self.kind == "zero3":
            return p.ds_tensor.data.view(-1)[: self.local_numel]
        return p.data.view(-1)[self.start : self.end]

    def master(self) -> torch.Tensor | None:
        """The fp32 master copy of this rank's range, where the engine keeps a separate one."""
        p = self.param
        if self.kind == "zero3":
            from deepspeed.utils import safe_get_local_fp32_param

            return safe_get_local_fp32_param(p).view(-1)[: self.local_numel]
        if self.kind == "zero12" and p._hp_mapping is not None:
            return p._hp_mapping.get_hp_fragment().data.view(-1)
        return None

    def weight(self) -> torch.Tensor:
        """fp32 weights of this rank's range, for scoring (the master copy where there is one)."""
        m = self.master()
        return (m if m is not None else self.lp()).detach().float()

    @torch.no_grad()
    def grad(self) -> torch.Tensor:
        """fp32 gradient of this rank's range, reduced across ranks (zeros if the weight got none)."""
        p = self.param
        g: torch.Tensor | None
        if self.kind == "dtensor":
            g = None if p.grad is None else p.grad.to_local().reshape(-1)
        elif self.kind == "zero3":
            from deepspeed.utils import safe_get_local_grad

            g = safe_get_local_grad(p)
            g = None if g is None else g.reshape(-1)[: self.local_numel]
        elif self.kind == "zero12":
            if p._hp_mapping is None:
                g = None
            else:
                g = p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
                if g.numel() == self.numel and self.numel != self.local_numel:
                    g = g[self.start : self.end]  # bf16 optimizer keeps a full accumulation buffer
        else:
            g = None if p.grad is None else p.grad.reshape(-1)[self.start : self.end]
        if g is None:
            return torch.zeros(self.local_numel, dtype=torch.float32, device=self.lp().device)
        if g.numel() != self.local_numel:
            raise RuntimeError(f"{self.name}: local gradient has {g.numel()} elements, range has {self.local_numel}")
        return g.detach().float()

    # ------------------------------------------------------------------ writing

    @torch.no_grad()
    def write(self, mask: torch.Tensor, values: torch.Tensor | float, master: bool) -> None:
        """Set weights of this rank's range at `mask` (working copy, and fp32 master if asked).

        Replicated working copies are re-synchronised by `sync_views` afterwards.
        """
        lp = self.lp()
        v = values.to(lp.dtype) if torch.is_tensor(values) else values
        lp[mask] = v
        if master and self.kind == "zero3":
            from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

            full = safe_get_local_fp32_param(self.param).clone()
            part = full.view(-1)[: self.local_numel]
            part[mask] = values.float() if torch.is_tensor(values) else values
            safe_set_local_fp32_param(self.param, full)
        elif master and self.kind == "zero12" and self.param._hp_mapping is not None:
            hp = self.param._hp_mapping.get_hp_fragment().data.view(-1)
            hp[mask] = values.to(hp.dtype) if torch.is_tensor(values) else values


def gather_full(view: ShardView, local: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """The whole matrix of a per-range tensor (only for replicated weights, where each rank
    holds the full weight anyway and needs, e.g., the full mask to apply)."""
    assert view.layout is not None
    lengths = [b - a for a, b in view.layout.ranges]
    pieces = comm.all_gather_varlen(local.reshape(-1), lengths)
    full = torch.empty(view.numel, dtype=local.dtype, device=local.device)
    for (a, b), piece in zip(view.layout.ranges, pieces):
        full[a:b] = piece
    return full


@torch.no_grad()
def sync_views(views: list[ShardView], comm: Collectives) -> None:
    """Make every rank's working weights agree again after `write` calls.

    Replicated copies: all-gather each rank's range. ZeRO-3: parameters that DeepSpeed
    keeps gathered (persistent small ones) are re-gathered from the partitions.
    Collective: call with the same views on every rank.
    """
    for v in views:
        if v.replicated_lp and comm.distributed:
            v.param.data.view(-1).copy_(gather_full(v, v.lp().detach().clone(), comm))
        elif v.kind == "zero3":
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            p = v.param
            if p.ds_status == ZeroParamStatus.AVAILABLE:
                parts = comm.all_gather_varlen(p.ds_tensor.data.view(-1), [p.ds_tensor.numel()] * comm.world)
                p.data.view(-1).copy_(torch.cat(parts)[: v.numel])


def build_views(model_or_engine: Any, targets: str, comm: Collectives) -> list[ShardView]:
    """A ShardView per target, in a deterministic order identical on every rank."""
    module = unwrap(model_or_engine)
    views = []
    for t in find_targets(module, targets):
        p = t.module.weight
        rows, cols = _global_shape(p)
        kind, start, end = _local_range(p, rows, cols, comm)
        views.append(ShardView(t, kind, rows, cols, start, end))
    for v, ranges in zip(views, gather_ranges([(v.start, v.end) for v in views], comm)):
        v.layout = Layout(v.rows, v.cols, v.start, v.end, ranges)
    return views


def _global_shape(p: torch.Tensor) -> tuple[int, int]:
    if hasattr(p, "ds_shape"):
        shape = tuple(p.ds_shape)
    else:
        shape = tuple(p.shape)
    if len(shape) != 2:
        raise ValueError(f"expected a 2-D Linear weight, got shape {shape}")
    return int(shape[0]), int(shape[1])


def _local_range(p: torch.Tensor, rows: int, cols: int, comm: Collectives) -> tuple[str, int, int]:
    """This rank's flat range of a weight: the engine's own storage (FSDP2 rows, a ZeRO-3
    partition; `harness.engine.local_part`), ZeRO-1/2's fragment, or an even split of a replica."""
    if isinstance(p, DTensor):
        if p.device_mesh.ndim != 1 or p.device_mesh.size() != comm.world:
            raise NotImplementedError(f"FSDP2 mesh {tuple(p.device_mesh.shape)}: only a 1-D mesh over all ranks is supported (no HSDP)")
        return "dtensor", *local_part(p)[1:3]
    if hasattr(p, "ds_id"):
        if dist.get_world_size(getattr(p, "ds_process_group", None)) != comm.world:
            raise NotImplementedError("ZeRO-3 partition groups smaller than the world (MiCS/hpZ) are not supported")
        return "zero3", *local_part(p)[1:3]
    if hasattr(p, "_hp_mapping"):
        mapping = p._hp_mapping
        if mapping is None:
            return "zero12", 0, 0
        a = mapping.lp_fragment_address.start
        return "zero12", a, a + mapping.lp_fragment_address.numel
    a, b = even_ranges(rows * cols, comm.world)[comm.rank]
    return "replicated", a, b
