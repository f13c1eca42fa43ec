"""Per-rank bytes of model state actually held: parameters, gradients, optimizer state.

Sharding is proven by these numbers, never by a flag: each tensor storage an engine keeps
is found and counted once. For DeepSpeed the storages live inside its optimizer object
(flat partitions, gradient buffers, fp32 master copies), so we walk that object's tensor
attributes and classify them by what they hold. A quantized optimizer state (torchao's 8-/4-bit
moments) is a tensor subclass with no storage of its own: its inner tensors (codes, block scales,
code book) are what it holds, found through the subclass protocol's ``__tensor_flatten__``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from harness.distributed import local_tensor
from harness.memory import STATE_CATEGORIES


class StateCounter:
    """Counts each storage once, in the first category that claims it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = dict.fromkeys(STATE_CATEGORIES, 0)

    def add(self, category: str, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            t = local_tensor(t)
            if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
                self.add(category, [getattr(t, name) for name in t.__tensor_flatten__()[0]])
                continue
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self.seen:
                continue
            self.seen.add(key)
            self.bytes[category] += storage.nbytes()


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    state = getattr(optimizer, "state", {})
    return [t for s in state.values() for t in (s.values() if isinstance(s, dict) else []) if isinstance(t, torch.Tensor) and t.dim() > 0]


def _tensors_in(value: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    return []


def _classify_ds_attribute(name: str) -> str | None:
    lowered = name.lower()
    if "grad" in lowered:
        return "grads"
    if "fp32" in lowered or "master" in lowered or "single_partition" in lowered:
        return "master_params"
    if any(k in lowered for k in ("bit16", "fp16", "lp_param", "partitioned_groups_flat")):
        return "params"
    return None


def deepspeed_state_bytes(ds_engine: Any) -> dict[str, int]:
    """DeepSpeed ZeRO 0-3: walk the engine's optimizer for the storages it holds."""
    counter = StateCounter()
    module = ds_engine.module
    params = list(module.parameters())
    # ZeRO-3 keeps each rank's partition in `ds_tensor`; the full `param.data` is freed.
    counter.add("params", [getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p for p in params])
    counter.add("grads", [p.grad for p in params if p.grad is not None])
    zero_opt = ds_engine.optimizer
    # ZeRO 1-3 and DeepSpeed's bf16/fp16 wrappers hold the torch optimizer as `.optimizer`; at
    # stage 0 without a wrapper the engine's optimizer is the torch optimizer itself.
    base = getattr(zero_opt, "optimizer", None) or zero_opt
    counter.add("optim_state", optimizer_state_tensors(base))
    # Gradients first (buffers whose names say so), then master copies, then flat params.
    attrs = {}
    for name, value in vars(zero_opt).items():
        category = _classify_ds_attribute(name)
        if category:
            attrs.setdefault(category, []).extend(_tensors_in(value))
    for category in ("grads", "master_params", "params"):
        counter.add(category, attrs.get(category, []))
    return counter.bytes
