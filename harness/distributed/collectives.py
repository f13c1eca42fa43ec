"""Every collective harness issues, on one object that picks its device once.

A run issues collectives from several places: the trainer (the logged loss, eval sums,
memory peaks), the step guard (agreeing on a NaN or a stop request), the run directory's
refusals, and the pruning stage (statistics, exact selection, masks). They all need the
same three decisions: is there a group at all (a single process has none), how large is
it, and on which device must a collective's tensor live (NCCL: the GPU; gloo: the CPU,
where our bookkeeping lives anyway). Making those decisions once, here, means no caller
asks "am I distributed?" and every collective in the project is one of these audited calls.

Every method is a collective when `world > 1`: all ranks must call it in the same order
with tensors of the same shape and dtype, which is what keeps ranks' decisions identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Collectives:
    """Collectives over one process group (default: the world), with a world-of-one fallback."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            backend = dist.get_backend(group)
        else:
            self.rank, self.world, backend = 0, 1, None
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = device

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # Tensors: the result is a new tensor on the input's device (the input is untouched).

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum across ranks."""
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum across ranks."""
        return self._all_reduce(t, dist.ReduceOp.MAX)

    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if not self.distributed:
            return t.clone()
        buf = t.to(self.device, copy=True)
        dist.all_reduce(buf, op=op, group=self.group)
        return buf.to(t.device)

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

    # Plain Python values: float64 on the wire, so sums of counts stay exact.

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed across ranks."""
        if not self.distributed:
            return list(values)
        return self.all_reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()

    def mean(self, value: float) -> float:
        """`value` averaged over ranks."""
        return self.sum([value])[0] / self.world

    def any(self, flags: list[bool]) -> list[bool]:
        """Each flag true on some rank: what makes every rank take the same branch."""
        if not self.distributed:
            return list(flags)
        return [x > 0 for x in self.all_reduce_max(torch.tensor([1.0 if f else 0.0 for f in flags])).tolist()]

    def all(self, flag: bool) -> bool:
        """`flag` true on every rank."""
        return not self.any([not flag])[0]

    def all_reduce_min_int(self, value: int) -> int:
        """The smallest `value` over ranks."""
        if not self.distributed:
            return value
        buf = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self.group)
        return int(buf.item())

    def gather_object(self, obj: object) -> list[object]:
        """Every rank's picklable `obj`, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)
