"""Activation offloading: tensors saved for backward live in host memory between forward and backward.

``torch.autograd.graph.saved_tensors_hooks`` gives us every tensor autograd saves: the
pack hook copies it to (pinned) host memory and hands autograd a small handle, the
unpack hook copies it back when backward needs it. The accelerator then holds an
activation only while the op producing it runs, at the price of PCIe traffic.

What is offloaded: saved tensors on an accelerator of at least ``min_bytes``.
What is not: parameters and views of parameters (e.g. the transposed weight ``mm``
saves) - they stay resident anyway, so copying them would only add traffic and host
memory; small tensors (copy latency dominates); tensors already on the host.

Two scopes. ``all`` (``memory.activation_offload``): every saved tensor, copied
``non_blocking`` on the current stream into pinned buffers; stream order makes that correct
without extra synchronisation, and it does not overlap the copies with compute.
``checkpoint_inputs`` (``memory.offload_checkpoint_inputs``): only the inputs that activation
checkpointing keeps for each checkpointed block (torch's non-reentrant checkpoint saves its
inputs as saved tensors, before its own hooks take over inside the block, so they reach these
hooks; which tensors are block inputs is recorded by a forward pre-hook on each checkpointed
block). Those are few and large (one ``micro_batch x seq x hidden`` tensor per block, the
whole activation footprint under full checkpointing at long sequence) and used in a known
order, so on CUDA they move on a side stream: the copy to the host overlaps the next block's
forward (the allocator is told the device block is in use on that stream until the copy
ends), and in backward, when one block's input is unpacked for its recomputation, the inputs
of the next ``prefetch`` blocks backward are already being copied back, so at most
``prefetch`` + 1 of them are on the device at once.

On a CPU-only machine the device *is* the host: with ``copy_on_host=False`` (default)
tensors are kept by reference in the store (nothing to move), with ``copy_on_host=True``
the pack/unpack copy path runs (into unpinned memory), which is how the tests exercise
the copy logic; the prefetch order and bound run there too (synchronous copies, no streams)
and ``OffloadStats`` accounts the bytes moved and prefetched. Neither can show a
device-memory saving, which only a GPU run can. ``simulate=True`` (the planner's traced
step, fake tensors without data): the device tensor is released at pack time and an empty one
of its layout comes back at unpack or prefetch, which is the device-memory timeline of the
real offload; the host bytes are the store's. Each pinned copy holds what torch's caching host
allocator takes for it (`harness.memory.pinned`: the next power of two), counted in
``OffloadStats.peak_pinned_bytes`` (in simulation too, when ``pin_memory``: the planner's GPU run).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from harness.memory.pinned import pinned_block

OffloadScope = Literal["all", "checkpoint_inputs"]


@dataclass
class OffloadStats:
    """What one offload context did (reset on entry)."""

    packed: int = 0  # saved tensors seen by the pack hook
    offloaded: int = 0  # of those, moved to / held in the host store
    offloaded_bytes: int = 0
    kept: int = 0  # left where they were (parameters, small, already on host without copy_on_host, not a checkpoint input)
    deduplicated: int = 0  # saved again by another op: served by the existing host copy
    unpacked: int = 0
    prefetched: int = 0  # brought back ahead of their unpack (checkpoint inputs)
    peak_store_bytes: int = 0  # largest host-store footprint during the context
    peak_pinned_bytes: int = 0  # the same moment's pinned copies as the caching host allocator holds them (rounded up)
    peak_fetched_bytes: int = 0  # largest device footprint of inputs brought back and not yet unpacked
    reasons: dict[str, int] = field(default_factory=dict)


class _Handle:
    """What autograd holds instead of an offloaded tensor; its host copy dies with it.

    Autograd drops the handle when the node that saved it is freed (after its backward,
    or with the graph), so the store needs no explicit pop and ``retain_graph=True``
    (several unpacks of one handle) works. ``fetched``: the device copy brought back ahead
    of its unpack (prefetch), with the event its copy records on a side stream.
    """

    __slots__ = ("host", "device", "nbytes", "pinned", "owner", "layout", "fetched", "event", "__weakref__")

    def __init__(
        self, host: torch.Tensor | None, device: torch.device, nbytes: int, owner: ActivationOffload, layout: Any, pinned: int = 0
    ) -> None:
        self.host, self.device, self.nbytes, self.owner, self.layout = host, device, nbytes, owner, layout
        self.pinned = pinned  # bytes of its pinned block (0: not pinned)
        self.fetched: torch.Tensor | None = None
        self.event: Any = None

    def __del__(self) -> None:
        self.owner._store_bytes -= self.nbytes
        self.owner._pinned_bytes -= self.pinned
        if self.fetched is not None:
            self.owner._fetched_bytes -= self.nbytes


def _is_param_or_view(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class ActivationOffload:
    """Context manager: saved activations go to host memory in forward and come back in backward.

    Use around forward only (backward may run outside it; the hooks captured by autograd
    at pack time are the ones used at unpack time). One instance serves every micro-batch of a
    run, entered around each forward: its side stream is made once, at its first CUDA input::

        offload = ActivationOffload()
        with offload:
            loss = causal_lm_loss(model, ids)
        loss.backward()

    ``scope="checkpoint_inputs"`` needs ``model`` (its checkpointed blocks are watched) and
    offloads only their inputs, on a side stream with ``prefetch`` blocks fetched ahead on CUDA.
    """

    def __init__(
        self,
        min_bytes: int = 1024,
        pin_memory: bool | None = None,
        copy_on_host: bool = False,
        *,
        scope: OffloadScope = "all",
        model: nn.Module | None = None,
        prefetch: int = 1,
        simulate: bool = False,
    ) -> None:
        if scope == "checkpoint_inputs" and model is None:
            raise ValueError("offloading checkpoint inputs needs the model whose checkpointed blocks to watch")
        self.min_bytes = min_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.copy_on_host = copy_on_host
        self.scope, self.model, self.prefetch, self.simulate = scope, model, max(0, prefetch), simulate
        self.stats = OffloadStats()
        self._store_bytes = 0
        self._pinned_bytes = 0
        self._fetched_bytes = 0
        self._seen: dict[tuple[Any, ...], tuple[weakref.ref, weakref.ref]] = {}
        self._inputs: dict[int, weakref.ref] = {}  # storages that are checkpointed blocks' inputs (this forward)
        self._order: list[weakref.ref] = []  # checkpoint-input handles in pack order (backward walks it in reverse)
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._watch: list[Any] = []
        self._stream: Any = None

    # ------------------------------------------------------------------ which tensors
    def _record_inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self._inputs[id(t.untyped_storage())] = weakref.ref(t.untyped_storage())

    def _is_checkpoint_input(self, t: torch.Tensor) -> bool:
        ref = self._inputs.get(id(t.untyped_storage()))
        return ref is not None and ref() is t.untyped_storage()

    def _keep(self, t: torch.Tensor, reason: str) -> torch.Tensor:
        self.stats.kept += 1
        self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + 1
        return t

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor) -> Any:
        self.stats.packed += 1
        if _is_param_or_view(t):
            return self._keep(t, "parameter")
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes:
            return self._keep(t, "small")
        if self.scope == "checkpoint_inputs" and not self._is_checkpoint_input(t):
            return self._keep(t, "not a checkpoint input")
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
        pins = self.pin_memory and (self.simulate or t.device.type != "cpu")  # simulated: the GPU run's copy
        handle = _Handle(self._to_host(t), t.device, nbytes, self, (t.shape, t.stride(), t.dtype), pinned_block(nbytes) if pins else 0)
        self._seen[key] = (weakref.ref(t.untyped_storage()), weakref.ref(handle))
        if self.scope == "checkpoint_inputs":
            self._order.append(weakref.ref(handle))
        self._store_bytes += nbytes
        self._pinned_bytes += handle.pinned
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += nbytes
        self.stats.peak_store_bytes = max(self.stats.peak_store_bytes, self._store_bytes)
        self.stats.peak_pinned_bytes = max(self.stats.peak_pinned_bytes, self._pinned_bytes)
        return handle

    def _to_host(self, t: torch.Tensor) -> torch.Tensor | None:
        on_host = t.device.type == "cpu"
        if self.simulate:
            return None  # fake tensors: nothing to copy; the device tensor is released
        if on_host and not self.copy_on_host:
            return t  # already in host memory: hold it in the store, no copy
        # empty_like keeps the strides of dense tensors (e.g. a transposed view), so
        # backward sees the same memory layout and gives bit-identical results.
        host = torch.empty_like(t, device="cpu", pin_memory=self.pin_memory and not on_host)
        stream = self._side_stream(t)
        if stream is None:
            host.copy_(t, non_blocking=not on_host)
            return host
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # its device block is not reused before the copy is done
        return host

    def _side_stream(self, t: torch.Tensor) -> Any:
        if self.scope != "checkpoint_inputs" or t.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        return self._stream

    def _fetch(self, handle: _Handle) -> None:
        """Start bringing ``handle``'s tensor back to its device (on the side stream on CUDA)."""
        if handle.fetched is not None:
            return
        if self.simulate:
            shape, stride, dtype = handle.layout
            handle.fetched = torch.empty_strided(shape, stride, dtype=dtype, device=handle.device)
        elif handle.device.type == "cpu":
            handle.fetched = handle.host
        else:
            stream = self._stream if self.scope == "checkpoint_inputs" else None
            if stream is None:
                handle.fetched = handle.host.to(handle.device, non_blocking=True)
            else:  # the host copy was made on this stream: stream order has it complete; compute goes on meanwhile
                with torch.cuda.stream(stream):
                    handle.fetched = handle.host.to(handle.device, non_blocking=True)
                    handle.event = torch.cuda.Event()
                    handle.event.record(stream)
        self._fetched_bytes += handle.nbytes
        self.stats.peak_fetched_bytes = max(self.stats.peak_fetched_bytes, self._fetched_bytes)

    def _prefetch_before(self, handle: _Handle) -> None:
        """Fetch the ``prefetch`` checkpoint inputs packed just before ``handle`` (backward's next ones)."""
        index = next((i for i, ref in enumerate(self._order) if ref() is handle), None)
        if index is None:
            return
        for ref in reversed(self._order[max(0, index - self.prefetch) : index]):
            ahead = ref()
            if ahead is not None and ahead.fetched is None:
                self._fetch(ahead)
                self.stats.prefetched += 1
        del self._order[index:]  # unpacked: backward is past these blocks

    def _unpack(self, packed: Any) -> torch.Tensor:
        self.stats.unpacked += 1
        if isinstance(packed, torch.Tensor):
            return packed
        if self.scope == "all" and not self.simulate:
            if packed.device.type == "cpu":
                return packed.host
            return packed.host.to(packed.device, non_blocking=True)
        self._fetch(packed)
        self._prefetch_before(packed)
        out, event = packed.fetched, packed.event
        packed.fetched, packed.event = None, None
        self._fetched_bytes -= packed.nbytes
        if event is not None:  # copied on the side stream: the compute stream waits for it, and owns it from here
            current = torch.cuda.current_stream(packed.device)
            current.wait_event(event)
            out.record_stream(current)
        return out

    # ------------------------------------------------------------------ context
    def __enter__(self) -> ActivationOffload:
        if self._hooks is not None:
            raise RuntimeError("ActivationOffload is already entered: it is not re-entrant")
        self.stats = OffloadStats()
        self._seen.clear()
        self._inputs.clear()
        self._order.clear()
        if self.scope == "checkpoint_inputs":
            assert self.model is not None
            blocks = [m for m in self.model.modules() if isinstance(m, CheckpointWrapper)]
            self._watch = [b.register_forward_pre_hook(self._record_inputs, with_kwargs=True) for b in blocks]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        for hook in self._watch:
            hook.remove()
        self._watch = []
        self._seen.clear()
        self._inputs.clear()

    @property
    def store_bytes(self) -> int:
        """Bytes currently held in the host store (0 once the graph that saved them is freed)."""
        return self._store_bytes

    @property
    def fetched_bytes(self) -> int:
        """Device bytes of checkpoint inputs brought back and not yet handed to backward."""
        return self._fetched_bytes


__all__ = ["ActivationOffload", "OffloadScope", "OffloadStats"]
