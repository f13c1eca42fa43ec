"""The few collectives the pruning stage needs, with a world-of-one fallback.

Pruning runs with or without a process group (a single-process run has none), and on
NCCL the tensors of a collective must live on the GPU while our bookkeeping lives on the
CPU. Keeping that in one small class means the selection code never asks "am I
distributed?" and every collective it issues is one of four audited calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Comm:
    """Collectives over one process group (the data-parallel/sharding group).

    Every method is a collective when `world > 1`: all ranks must call it in the same
    order with tensors of the same shape and dtype, which is what makes the stage's
    results identical across ranks.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            backend = dist.get_backend(group)
        else:
            self.rank, self.world, backend = 0, 1, None
        if device is None:
            if backend == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        self.device = device

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum across ranks; returns a new tensor on `t`'s device (input untouched)."""
        if not self.distributed:
            return t.clone()
        buf = t.to(self.device, copy=True)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return buf.to(t.device)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return t.clone()
        buf = t.to(self.device, copy=True)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        return buf.to(t.device)

    def all_reduce_min_int(self, value: int) -> int:
        if not self.distributed:
            return value
        buf = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self.group)
        return int(buf.item())

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape on all ranks), in rank order."""
        if not self.distributed:
            return [t.clone()]
        src = t.to(self.device).contiguous()
        out = [torch.empty_like(src) for _ in range(self.world)]
        dist.all_gather(out, src, group=self.group)
        return [o.to(t.device) for o in out]

    def all_gather_varlen(self, t: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        """Every rank's 1-D `t` where rank r's length is `lengths[r]` (known to all ranks).

        Pads to the longest piece so a plain all_gather works on gloo and NCCL alike.
        """
        if not self.distributed:
            return [t.clone()]
        if t.numel() != lengths[self.rank]:
            raise ValueError(f"rank {self.rank} passes {t.numel()} elements, lengths say {lengths[self.rank]}")
        # Travel as same-width integers: bit-exact, and gloo lacks bool/bf16 for some ops.
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        src = t.reshape(-1).to(torch.uint8) if t.dtype == torch.bool else t.reshape(-1).contiguous().view(as_int)
        longest = max(lengths) if lengths else 0
        padded = torch.zeros(longest, dtype=src.dtype, device=t.device)
        padded[: src.numel()] = src
        pieces = [p[:n] for p, n in zip(self.all_gather(padded), lengths)]
        if t.dtype == torch.bool:
            return [p.bool() for p in pieces]
        return [p.view(t.dtype) for p in pieces]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)
