"""The bytes this rank sends through collectives, counted as they are dispatched.

Every collective is a dispatcher op: the process group's methods (FSDP2's gathers, DDP's bucket
all-reduce from its C++ reducer) in the `c10d` namespace, the functional collectives (transformers'
expert all-to-all, autograd's too) in `_c10d_functional`; so a `TorchDispatchMode` sees each one
with its tensors and its group. The same counter runs around a
real step (`harness.planner.measure`) and around the planner's fake-tensor trace of it
(`harness.planner.trace`, a fake process group): what is planned and what is measured are counted
by one rule.

What a rank sends, W the group's size, B the bytes of the tensors named:
  all-gather       B(input) x (W - 1): its shard to every other rank
  reduce-scatter   B(input) x (W - 1) / W: a ring's share
  all-reduce       B x 2 (W - 1) / W: a ring's reduce-scatter then all-gather
  all-to-all       B(input) less the rows it keeps (its own input split)
  broadcast        B x (W - 1) on the root, 0 elsewhere
Algorithms differ by backend (a tree, a direct exchange); these are the volumes the collectives
imply, the figure NCCL's own tests report as bus bytes. Barriers and point-to-point ops are not
collectives' payload and count 0; an unknown c10d op counts its tensors under "other".
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "other")
_KIND = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast",
}
_NO_PAYLOAD = {"barrier", "monitored_barrier_", "send", "recv_", "recv_any_source_"}
# The functional collectives: (kind, where their input is, where their group's name is)
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", 0, 2),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, 3),
    "all_reduce": ("all_reduce", 0, 2),
    "all_reduce_coalesced": ("all_reduce", 0, 2),
    "all_to_all_single": ("all_to_all", 0, 3),
    "broadcast": ("broadcast", 0, 2),
}


def _bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(v) for v in x)
    return 0


def _group(args: tuple[Any, ...]) -> Any:
    boxed = next(a for a in args if isinstance(a, torch.ScriptObject))
    return torch._C._distributed_c10d.ProcessGroup.unbox(boxed)


def _volume(kind: str, source: Any, w: int, rank: int, splits: list[int], root: int | None = None) -> int:
    """What one rank sends of `source` in a collective of `kind` over `w` ranks (the module's table)."""
    if kind == "all_gather":
        return _bytes(source) * (w - 1)
    if kind == "reduce_scatter":
        return _bytes(source) * (w - 1) // w
    if kind == "all_reduce":
        return _bytes(source) * 2 * (w - 1) // w
    if kind == "broadcast":
        return _bytes(source) * (w - 1) if rank == root else 0
    rows = source.shape[0] if source.dim() else 1  # all-to-all: less the rows it keeps (its own split)
    kept = splits[rank] if splits else rows // w
    return (rows - kept) * (_bytes(source) // max(1, rows))


def functional_sent_bytes(op: str, args: tuple[Any, ...]) -> tuple[str, int]:
    """(kind, bytes this rank sends) of one functional collective (`_c10d_functional`); ("other", 0)
    for its waits and wrappers, which move nothing."""
    if op not in _FUNCTIONAL:
        return "other", 0
    kind, source, name = _FUNCTIONAL[op]
    group = _resolve_process_group(args[name])
    splits = list(args[2]) if kind == "all_to_all" else []
    return kind, _volume(kind, args[source], group.size(), group.rank(), splits, args[1] if kind == "broadcast" else None)


def sent_bytes(op: str, args: tuple[Any, ...]) -> tuple[str, int]:
    """(kind, bytes this rank sends) of one c10d op called with `args` (its schema's positional arguments)."""
    if op in _NO_PAYLOAD:
        return "other", 0
    kind = _KIND.get(op, "other")
    if kind == "other":
        return kind, sum(_bytes(a) for a in args)
    group = _group(args)
    w, rank = group.size(), group.rank()
    if kind in ("all_reduce", "broadcast"):
        return kind, _volume(kind, args[0], w, rank, [], args[2] if kind == "broadcast" else None)
    # all-to-all: (output, input, group, output splits, input splits); the others: (output, input, ...)
    return kind, _volume(kind, args[1], w, rank, list(args[4]) if kind == "all_to_all" else [])


class CollectiveBytes(TorchDispatchMode):
    """While active: `sent[kind]`, the bytes this rank sends by collective kind, and `calls[kind]`."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        counted = {"c10d": sent_bytes, "_c10d_functional": functional_sent_bytes}.get(func.namespace)
        if counted is not None:
            kind, n = counted(func._opname, args)
            if n or kind != "other":
                self.sent[kind] += n
                self.calls[kind] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.sent.values())


__all__ = ["KINDS", "CollectiveBytes", "functional_sent_bytes", "sent_bytes"]
