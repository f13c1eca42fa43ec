"""The pieces under StepMemoryTracker: torch's MemTracker/FSDPMemTracker extended to keep each
category's own maximum and to survive gradient accumulation, plus direct byte counts for what
those trackers cannot see (DeepSpeed's optimizer state, compiled graphs' saved tensors).
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from harness.memory.categories import CATEGORIES, category_of


class _CategoryMaxima:
    """Mixin: each category's running maximum, updated on every change of the live snapshot.

    A category made of several tracker types (sharded + unsharded gradients, all-gather +
    reduce-scatter buffers) is maximised as their *sum* at each instant.
    """

    def _init_maxima(self) -> None:
        self.raw_max: dict[tuple[torch.device, Any], int] = {}
        self.category_max: dict[tuple[torch.device, str], int] = {}

    def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None, old_reftype: Any = None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)  # type: ignore[misc]
        snap = self._curr_mem_snap.get(winfo.device)  # type: ignore[attr-defined]
        if snap is None:
            return
        key = (winfo.device, winfo.reftype)
        if snap[winfo.reftype] > self.raw_max.get(key, 0):
            self.raw_max[key] = snap[winfo.reftype]
        category = category_of(winfo.reftype)
        if category is not None:
            total = sum(v for k, v in snap.items() if category_of(k) == category)
            ckey = (winfo.device, category)
            if total > self.category_max.get(ckey, 0):
                self.category_max[ckey] = total


def _retry_on_repeat(tracker: MemTracker, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a pre-forward hook; on MemTracker's "multiple iterative calls" refusal, reset and rerun.

    A step with gradient accumulation runs the root forward once per micro-batch. Only the
    per-module stats need a fresh start (peaks and followed tensors carry over), and the
    refusal is raised before the hook mutates anything, so rerunning is safe.
    """
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        if "multiple iterative calls" not in str(e):
            raise
        tracker.reset_mod_stats()
        return fn(*args, **kwargs)


class _NoHook:
    """Stands in for the gradient hooks MemTracker would register on a frozen parameter."""

    def remove(self) -> None:
        pass


def _skip_frozen(tracker: MemTracker, module: nn.Module) -> None:
    """MemTracker registers a gradient hook on every parameter, which torch refuses for one that
    does not require a gradient (a LoRA run's frozen base): mark those as already hooked. Their
    bytes are still counted as parameters; they never get a gradient to count."""
    handles = tracker._param_to_grad_hook_handles
    for p in module.parameters():
        if not p.requires_grad and p not in handles:
            handles[p] = (_NoHook(), _NoHook())


class _Tracker(_CategoryMaxima, MemTracker):
    def __init__(self) -> None:
        super().__init__()
        self._init_maxima()

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        _skip_frozen(self, module)
        _retry_on_repeat(self, super()._pre_fw_hook, module, inputs)


class _FSDPTracker(_CategoryMaxima, FSDPMemTracker):
    """FSDPMemTracker that follows any number of optimizers (optimizer-in-backward has one per parameter)."""

    def __init__(self, root: nn.Module, optimizers: list[Any]) -> None:
        super().__init__(root, None)
        self._init_maxima()
        self._optimizers = optimizers

    def _instrument_optimizer(self) -> None:
        opt_type = self._ref_class("OptState")
        for optimizer in self._optimizers:
            self._track_optimizer_states(opt_type, optimizer)

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._in_opt = True

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._track_optimizer_states(opt_type, optimizer)
            self._in_opt = False

        self._optimizer_hook_handles = (register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post))

    def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)
        return lambda *args, **kwargs: _retry_on_repeat(self, inner, *args, **kwargs)


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    local = t.to_local() if hasattr(t, "to_local") else t
    return [local.untyped_storage()]


def _tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        for st in _storages(t):
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


class _LiveBytes:
    """Live bytes of a set of storages, followed by weakref (dies with the storage)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        for st in _storages(t):
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


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every state tensor of a torch optimizer, an OptimizerInBackward or a DeepSpeed ZeRO optimizer.

    For DeepSpeed the inner torch optimizer's parameters are ZeRO's fp32 master
    partitions (not module parameters), so they count as optimizer state here.
    """
    if optimizer is None:
        return
    if hasattr(optimizer, "optimizers") and isinstance(optimizer.optimizers, dict):  # OptimizerInBackward
        for inner in optimizer.optimizers.values():
            yield from optimizer_tensors(inner)
        return
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "state"):  # DeepSpeed wrapper around a torch optimizer
        # fp32 masters: ZeRO-1/2 `single_partition_of_fp32_groups`, ZeRO-3
        # `fp32_partitioned_groups_flat` (ZeRO-3 empties the inner param_groups outside step()).
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            yield from (t for t in getattr(optimizer, attr, None) or [] if isinstance(t, torch.Tensor))
        for group in inner.param_groups:
            yield from (p for p in group["params"] if isinstance(p, torch.Tensor))
        optimizer = inner
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def parameter_storages(model: nn.Module) -> set[int]:
    """Data pointers of the storages holding ``model``'s parameters (ZeRO-3: their ``ds_tensor`` partitions)."""
    ptrs = set()
    for p in model.parameters():
        for t in (p, getattr(p, "ds_tensor", None)):
            if isinstance(t, torch.Tensor):
                ptrs.update(st.data_ptr() for st in _storages(t) if st.nbytes())
    return ptrs


def optimizer_state_bytes(optimizer: Any, model: nn.Module | None = None) -> int:
    """Bytes of optimizer state, each storage once, not counting storages that are ``model``'s parameters.

    (ZeRO-3 with fp32 parameters uses the parameter partition itself as the fp32 master.)
    """
    exclude = parameter_storages(model) if model is not None else set()
    seen: dict[int, int] = {}
    for t in optimizer_tensors(optimizer):
        for st in _storages(t):
            if st.data_ptr() not in exclude and st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _torch_optimizers(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    if hasattr(optimizer, "optimizers") and isinstance(optimizer.optimizers, dict):
        return list(optimizer.optimizers.values())
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else [optimizer]


def is_compiled(model: nn.Module) -> bool:
    """Whether any part of ``model`` runs through torch.compile."""
    return any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def _peaks(rec: dict[str, Any]) -> dict[str, Any]:
    return {**rec.get("peak", {}), **{k: rec[k] for k in ("device_allocated", "device_reserved") if k in rec}}


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _to_categories(snap: dict[Any, int]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for reftype, value in snap.items():
        cat = category_of(reftype)
        if cat is not None:
            out[cat] += value
    out["total"] = snap.get("Total", sum(out.values()))
    return out


def write_module_report(tracker: MemTracker, path: str) -> str:
    """The tracker's per-module report (sizes and per-state snapshots by category) as JSON."""
    modules = {}
    for stats in tracker.memory_tracking.values():
        entry: dict[str, Any] = {
            k: getattr(stats, k) for k in ("parameter_mem", "buffer_mem", "input_mem", "output_mem") if hasattr(stats, k)
        }
        for state, snaps in stats.snapshots.items():
            entry[getattr(state, "value", str(state))] = [{str(dev): _to_categories(snap) for dev, snap in s.items()} for s in snaps]
        modules[stats.mod_fqn] = entry
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"peak": {str(d): _to_categories(s) for d, s in tracker.get_tracker_snapshot("peak").items()}, "modules": modules}, f, indent=1
        )
    return path
