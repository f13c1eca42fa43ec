"""Per-rank bytes of model state actually held: parameters, gradients, optimizer state.

Sharding is proven by these numbers, never by a flag: each tensor storage an engine keeps
is found and counted once. For DeepSpeed the storages live inside its optimizer object
(flat partitions, gradient buffers, fp32 master copies), so we walk that object's tensor
attributes and classify them by what they hold.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

CATEGORIES = ("params", "master_params", "grads", "optim_state")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Counter:
    """Counts each storage once, in the first category that claims it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = dict.fromkeys(CATEGORIES, 0)

    def add(self, category: str, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            t = _local(t)
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self.seen:
                continue
            self.seen.add(key)
            self.bytes[category] += storage.nbytes()


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


def _optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    state = getattr(optimizer, "state", {})
    return [t for s in state.values() for t in (s.values() if isinstance(s, dict) else []) if isinstance(t, torch.Tensor) and t.dim() > 0]


def torch_state_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Single/DDP/FSDP2: local shards of parameters, their gradients and optimizer state."""
    counter = _Counter()
    params = list(model.parameters())
    counter.add("params", params)
    counter.add("grads", [p.grad for p in params if p.grad is not None])
    optimizers = getattr(optimizer, "optimizers", None) or [optimizer]  # optimizer-in-backward holds many
    for opt in optimizers:
        if opt is not None:
            counter.add("optim_state", _optimizer_state_tensors(opt))
    return counter.bytes


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
    counter = _Counter()
    module = ds_engine.module
    params = list(module.parameters())
    # ZeRO-3 keeps each rank's partition in `ds_tensor`; the full `param.data` is freed.
    counter.add("params", [getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p for p in params])
    counter.add("grads", [p.grad for p in params if p.grad is not None])
    zero_opt = ds_engine.optimizer
    base = getattr(zero_opt, "optimizer", None)
    if base is not None:
        counter.add("optim_state", _optimizer_state_tensors(base))
    # Gradients first (buffers whose names say so), then master copies, then flat params.
    attrs = {}
    for name, value in vars(zero_opt).items():
        category = _classify_ds_attribute(name)
        if category:
            attrs.setdefault(category, []).extend(_tensors_in(value))
    for category in ("grads", "master_params", "params"):
        counter.add(category, attrs.get(category, []))
    return counter.bytes


def engine_state_bytes(engine: Any) -> dict[str, int]:
    if engine.kind == "deepspeed":
        return deepspeed_state_bytes(engine.ds)
    return torch_state_bytes(engine.model, engine.optimizer)
