"""This rank's part of each parameter, however the engine stores it: one object per parameter.

Pruning, masks and the memory report are written once against `ParamShard`: "this rank holds
the flat range [start, end) of the row-major parameter; here is a writable view of those
working weights, the fp32 master copy of them where the engine keeps one, and their gradient
(already reduced across ranks)", plus `write`, which updates working and master copies
together. Nothing outside `harness.engine` knows how a part is stored:

- replicated: a plain module (world 1) or DDP; every rank holds the whole tensor. A caller may
  split the work on it evenly across ranks (`split`), as ZeRO would split the storage;
- dtensor: FSDP2 `fully_shard`, Shard(0) rows of a DTensor (`to_local()`);
- zero3 / zero12: DeepSpeed's partitions (`harness.engine.deepspeed_shards`).

`harness.engine.shards.shard_of` picks the class for a parameter.

`storage` names the scheme, for reports and tests only: callers branch on the capabilities
(`replicated_working`, `keeps_full_working`, `full_working()`), never on the name.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn


class ParamShard:
    """This rank's part of one parameter: its range, working/master/gradient views, and `write`."""

    storage: ClassVar[str] = "replicated"
    # Every rank holds the whole working tensor: writes to this rank's range must be re-gathered
    # into the other ranks' copies (`full_working` is that tensor).
    replicated_working: ClassVar[bool] = True

    def __init__(self, name: str, param: nn.Parameter, shape: tuple[int, ...], start: int, end: int) -> None:
        self.name, self.param, self.shape, self.start, self.end = name, param, shape, start, end

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def local_numel(self) -> int:
        return self.end - self.start

    @property
    def keeps_full_working(self) -> bool:
        """Whether this rank keeps the whole working tensor between steps (a replica, ZeRO-1/2's
        working weights, a ZeRO-3 persistent parameter): a full-size mask applied to it stays local."""
        return self.replicated_working

    def working(self) -> torch.Tensor:
        """A writable 1-D view of the working (forward) weights of this rank's range."""
        return self.param.data.view(-1)[self.start : self.end]

    def master(self) -> torch.Tensor | None:
        """The fp32 master copy of this rank's range, where the engine keeps a separate one."""
        return None

    def grad(self) -> torch.Tensor | None:
        """This rank's range of the gradient, reduced across ranks; None if the parameter got none."""
        g = self.param.grad
        return None if g is None else g.reshape(-1)[self.start : self.end]

    def full_working(self) -> torch.Tensor | None:
        """The whole working tensor where this rank holds it whole right now, else None."""
        return self.param.data

    @torch.no_grad()
    def write(self, mask: torch.Tensor | slice, values: torch.Tensor | float, master: bool) -> None:
        """Set this rank's range at `mask` (a boolean mask, or `slice(None)`: all of it, a plain copy)
        in the working copy and, if `master`, in the fp32 master (where there is one) in the same
        step, so the optimizer cannot copy the old value back.
        A replicated working copy is not re-gathered here (that is a collective: the caller's)."""
        working = self.working()
        working[mask] = values.to(working.dtype) if torch.is_tensor(values) else values
        if self.storage == "replicated":
            # A write through `.data` leaves the version counter alone; bump it so that whatever
            # keys on it (the pruning probe's forward cache) sees the weights change.
            torch.autograd.graph.increment_version(self.param)
        if master:
            self._write_master(mask, values)

    def _write_master(self, mask: torch.Tensor | slice, values: torch.Tensor | float) -> None:
        """Engines with a separate fp32 master copy override this."""


class DTensorShard(ParamShard):
    """FSDP2: whole rows of dim 0, the DTensor's local shard; no separate master, never whole."""

    storage = "dtensor"
    replicated_working = False

    def working(self) -> torch.Tensor:
        return self.param.to_local().view(-1)

    def grad(self) -> torch.Tensor | None:
        g = self.param.grad
        return None if g is None else g.to_local().reshape(-1)

    def full_working(self) -> torch.Tensor | None:
        return None
