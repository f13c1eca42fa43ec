"""Activation offloading: tensors saved for backward live in host memory between forward and backward.

``torch.autograd.graph.saved_tensors_hooks`` gives us every tensor autograd saves: the
pack hook copies it to (pinned) host memory and hands autograd a small handle, the
unpack hook copies it back when backward needs it. The accelerator then holds an
activation only while the op producing it runs, at the price of PCIe traffic.

What is offloaded: saved tensors on an accelerator of at least ``min_bytes``.
What is not: parameters and views of parameters (e.g. the transposed weight ``mm``
saves) - they stay resident anyway, so copying them would only add traffic and host
memory; small tensors (copy latency dominates); tensors already on the host.

Copies are issued ``non_blocking`` on the current stream into pinned buffers. Stream
order makes that correct without extra synchronisation (the host copy is complete before
the H2D copy back is issued on the same stream; the freed device block is only reused by
later work on that stream) but it does not overlap the copy with compute. A side-stream
pipeline (torchtune's) would; this module trades that speed for simplicity.

On a CPU-only machine the device *is* the host: with ``copy_on_host=False`` (default)
tensors are kept by reference in the store (nothing to move), with ``copy_on_host=True``
the pack/unpack copy path runs (into unpinned memory), which is how the tests exercise
the copy logic. Neither can show a device-memory saving, which only a GPU run can.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn


@dataclass
class OffloadStats:
    """What one offload context did (reset on entry)."""

    packed: int = 0  # saved tensors seen by the pack hook
    offloaded: int = 0  # of those, moved to / held in the host store
    offloaded_bytes: int = 0
    kept: int = 0  # left where they were (parameters, small, already on host without copy_on_host)
    deduplicated: int = 0  # saved again by another op: served by the existing host copy
    unpacked: int = 0
    peak_store_bytes: int = 0  # largest host-store footprint during the context
    reasons: dict[str, int] = field(default_factory=dict)


class _Handle:
    """What autograd holds instead of an offloaded tensor; its host copy dies with it.

    Autograd drops the handle when the node that saved it is freed (after its backward,
    or with the graph), so the store needs no explicit pop and ``retain_graph=True``
    (several unpacks of one handle) works.
    """

    __slots__ = ("host", "device", "nbytes", "owner", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, nbytes: int, owner: ActivationOffload) -> None:
        self.host, self.device, self.nbytes, self.owner = host, device, nbytes, owner

    def __del__(self) -> None:
        self.owner._store_bytes -= self.nbytes


def _is_param_or_view(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class ActivationOffload:
    """Context manager: saved activations go to host memory in forward and come back in backward.

    Use around forward only (backward may run outside it; the hooks captured by autograd
    at pack time are the ones used at unpack time)::

        offload = ActivationOffload()
        with offload:
            loss = causal_lm_loss(model, ids)
        loss.backward()
    """

    def __init__(self, min_bytes: int = 1024, pin_memory: bool | None = None, copy_on_host: bool = False) -> None:
        self.min_bytes = min_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.copy_on_host = copy_on_host
        self.stats = OffloadStats()
        self._store_bytes = 0
        self._seen: dict[tuple[Any, ...], tuple[weakref.ref, weakref.ref]] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    # ------------------------------------------------------------------ hooks
    def _keep(self, t: torch.Tensor, reason: str) -> torch.Tensor:
        self.stats.kept += 1
        self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + 1
        return t

    def _pack(self, t: torch.Tensor) -> Any:
        self.stats.packed += 1
        if _is_param_or_view(t):
            return self._keep(t, "parameter")
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes:
            return self._keep(t, "small")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        seen = self._seen.get(key)
        if seen is not None:
            storage_ref, handle_ref = seen
            handle = handle_ref()
            # Same live storage object (so the same memory, not a reused address) and
            # same version: one host copy serves every op that saved this tensor
            # (q/k/v projections all save the same normed hidden states).
            if handle is not None and storage_ref() is t.untyped_storage():
                self.stats.deduplicated += 1
                return handle
        on_host = t.device.type == "cpu"
        if on_host and not self.copy_on_host:
            host = t  # already in host memory: hold it in the store, no copy
        else:
            # empty_like keeps the strides of dense tensors (e.g. a transposed view), so
            # backward sees the same memory layout and gives bit-identical results.
            host = torch.empty_like(t, device="cpu", pin_memory=self.pin_memory and not on_host)
            host.copy_(t, non_blocking=not on_host)
        handle = _Handle(host, t.device, nbytes, self)
        self._seen[key] = (weakref.ref(t.untyped_storage()), weakref.ref(handle))
        self._store_bytes += nbytes
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += nbytes
        self.stats.peak_store_bytes = max(self.stats.peak_store_bytes, self._store_bytes)
        return handle

    def _unpack(self, packed: Any) -> torch.Tensor:
        self.stats.unpacked += 1
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.device.type == "cpu":
            return packed.host
        return packed.host.to(packed.device, non_blocking=True)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> ActivationOffload:
        self.stats = OffloadStats()
        self._seen.clear()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        self._seen.clear()

    @property
    def store_bytes(self) -> int:
        """Bytes currently held in the host store (0 once the graph that saved them is freed)."""
        return self._store_bytes


__all__ = ["ActivationOffload", "OffloadStats"]
