"""torch's MemTracker/FSDPMemTracker extended to keep each category's own maximum and to survive
gradient accumulation, and the helpers that read their snapshots by category.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from harness.memory.categories import CATEGORIES, category_of
from harness.memory.tracking.counters import COUNTER_KEYS


class CategoryMaxima:
    """Mixin: each category's running maximum, updated on every change of the live snapshot.

    A category made of several tracker types (sharded + unsharded gradients, all-gather +
    reduce-scatter buffers) is maximised as their *sum* at each instant.
    """

    def _init_maxima(self) -> None:
        self.raw_max: dict[tuple[torch.device, Any], int] = {}
        self.category_max: dict[tuple[torch.device, str], int] = {}
        self._stats_by_fqn: dict[str, list[Any]] = {}
        self._stats_seen = -1  # len(memory_tracking) when _stats_by_fqn was built; -1: rebuild

    def reset_mod_stats(self) -> None:
        super().reset_mod_stats()  # type: ignore[misc]
        self._stats_seen = -1

    def _update_peak_stats(self, peak_state: Any) -> None:
        """MemTracker's own update, visiting only the modules now running instead of every module
        seen so far. It runs after every operator, so its cost was operators x modules: a split
        step of SmolLM2 with LoRA adapters (~600 more modules) took ~28 steps' time. The
        modules it skips are exactly those MemTracker's loop skips (not among the parents). A
        snapshot maps reference types to byte counts (ints), so a shallow copy is MemTracker's
        ``deepcopy`` for a fraction of its cost (it ran ~125k times a split step on SmolLM2)."""
        tracking = self.memory_tracking  # type: ignore[attr-defined]
        if self._stats_seen != len(tracking):
            self._stats_by_fqn = {}
            for stats in tracking.values():
                self._stats_by_fqn.setdefault(stats.mod_fqn, []).append(stats)
            self._stats_seen = len(tracking)
        curr_snap = self._curr_mem_snap  # type: ignore[attr-defined]
        for fqn in self._mod_tracker.parents:  # type: ignore[attr-defined]
            for mod_stats in self._stats_by_fqn.get(fqn, ()):
                if peak_state in mod_stats.snapshots:
                    for dev, dev_snap in curr_snap.items():
                        if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                            mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                            mod_stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:  # type: ignore[attr-defined]
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]  # type: ignore[attr-defined]
                self._peak_mem_snap[dev] = dict(dev_snap)  # type: ignore[attr-defined]

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


class FrozenAwareMemTracker(MemTracker):
    """torch's MemTracker for a model with frozen parameters (LoRA's base): as is, its first
    forward raises ``RuntimeError: cannot register a hook on a tensor that doesn't require
    gradient`` from the gradient hook it puts on every parameter of each module it enters.
    The trainer's tracker, the planner's trace and its ground-truth measurement all use this one."""

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        _skip_frozen(self, module)
        super()._pre_fw_hook(module, inputs)


class Tracker(CategoryMaxima, FrozenAwareMemTracker):
    def __init__(self) -> None:
        super().__init__()
        self._init_maxima()

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        _retry_on_repeat(self, super()._pre_fw_hook, module, inputs)


class FSDPTracker(CategoryMaxima, FSDPMemTracker):
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


def peaks(rec: dict[str, Any]) -> dict[str, Any]:
    return {**rec.get("peak", {}), **{k: rec[k] for k in COUNTER_KEYS if k in rec}}


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def to_categories(snap: dict[Any, int]) -> dict[str, int]:
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
            entry[getattr(state, "value", str(state))] = [{str(dev): to_categories(snap) for dev, snap in s.items()} for s in snaps]
        modules[stats.mod_fqn] = entry
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"peak": {str(d): to_categories(s) for d, s in tracker.get_tracker_snapshot("peak").items()}, "modules": modules}, f, indent=1
        )
    return path
