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
