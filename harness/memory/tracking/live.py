"""Direct byte counts for what the dispatch-mode trackers cannot see: storages followed by weakref
(compiled graphs' saved tensors), optimizer state however the optimizer is wrapped.

A tensor's bytes are its local storage's (`harness.distributed.local_tensor`: a DTensor's shard).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from harness.distributed import local_tensor
from harness.memory.tracking.storage import ModelStorage


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``t``'s local bytes: a tensor subclass without storage of its own
    (torchao's quantized optimizer states) holds its inner tensors' (``__tensor_flatten__``)."""
    t = local_tensor(t)
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        return [st for name in t.__tensor_flatten__()[0] for st in storages(getattr(t, name))]
    return [t.untyped_storage()]


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        for st in storages(t):
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


class LiveBytes:
    """Live bytes of a set of storages, followed by weakref (dies with the storage)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        for st in storages(t):
            key = id(st)
            if key in self._refs and self._refs[key]() is st:
                continue
            nbytes = st.nbytes()
            self._refs[key] = weakref.ref(st, lambda _r, n=nbytes, k=key: self._dead(k, n))
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _dead(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._refs.pop(key, None)


def optimizer_tensors(optimizer: Any, masters: Iterable[torch.Tensor] = ()) -> Iterator[torch.Tensor]:
    """Every state tensor of a torch optimizer, an OptimizerInBackward or a wrapper around a torch
    optimizer (DeepSpeed's ZeRO optimizers): `masters` are the wrapper's own fp32 copies
    (`ModelStorage.masters`), and the inner optimizer's parameters, which are those masters'
    partitions rather than module parameters, count as optimizer state too.
    """
    if optimizer is None:
        return
    if hasattr(optimizer, "optimizers") and isinstance(optimizer.optimizers, dict):  # OptimizerInBackward
        for inner in optimizer.optimizers.values():
            yield from optimizer_tensors(inner)
        return
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "state"):  # a wrapper around a torch optimizer (DeepSpeed)
        yield from (t for t in masters if isinstance(t, torch.Tensor))
        for group in inner.param_groups:
            yield from (p for p in group["params"] if isinstance(p, torch.Tensor))
        optimizer = inner
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def parameter_storages(model: nn.Module, partitions: Iterable[torch.Tensor] = ()) -> set[int]:
    """Data pointers of the storages holding ``model``'s parameters and the engine's `partitions` of them."""
    ptrs = set()
    for t in [*model.parameters(), *partitions]:
        if isinstance(t, torch.Tensor):
            ptrs.update(st.data_ptr() for st in storages(t) if st.nbytes())
    return ptrs


def optimizer_state_bytes(optimizer: Any, model: nn.Module | None = None, storage: ModelStorage | None = None) -> int:
    """Bytes of optimizer state, each storage once, not counting storages that are ``model``'s parameters.

    (ZeRO-3 with fp32 parameters uses the parameter partition itself as the fp32 master.)
    """
    storage = storage or ModelStorage()
    exclude = parameter_storages(model, storage.partitions()) if model is not None else set()
    seen: dict[int, int] = {}
    for t in optimizer_tensors(optimizer, storage.masters()):
        for st in storages(t):
            if st.data_ptr() not in exclude and st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def torch_optimizers(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    if hasattr(optimizer, "optimizers") and isinstance(optimizer.optimizers, dict):
        return list(optimizer.optimizers.values())
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else [optimizer]


def is_compiled(model: nn.Module) -> bool:
    """Whether any part of ``model`` runs through torch.compile."""
    return any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
