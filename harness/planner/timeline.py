"""The planner's per-op memory timeline: torch's MemTracker, one row of bytes per category per op.

A mixin over ``FrozenAwareMemTracker`` (harness.memory) that records every dispatched op's live
bytes by category, which module ran it and whether it ran in backward, recognises the
collective buffers FSDP2 hands to gloo (they count as communication), and follows FSDP2's
reduce-scattered gradient shards (so an engine that moves them off the device can take them out).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from harness.memory import CATEGORIES, FrozenAwareMemTracker, category_of

CATS = CATEGORIES  # one fixed order; every timeline row is a tuple in this order
CAT_INDEX = {c: i for i, c in enumerate(CATS)}


class _Timeline:
    """Mixin for MemTracker: one row of category bytes per dispatched op.

    torch's FSDPMemTracker names FSDP's collective buffers, but it loses track of the
    gradients FSDP2 accumulates unsharded across no-sync micro-batches (seen: 151 KB short
    on a tiny model where the plain tracker matched a real run to 8 bytes). So the plain
    tracker follows the bytes, and the collective buffers are recognised here instead:
    the output of an all-gather and the input of a reduce-scatter count as communication.
    """

    def _init_timeline(self) -> None:
        self.rows: list[tuple[int, ...]] = []
        self.phases: list[int] = []
        self.modules: list[int] = []
        self.module_names: list[str] = [""]
        self._module_index: dict[str, int] = {"": 0}
        self._comm: dict[int, Any] = {}  # id(storage) -> weakref to a storage used by a collective
        self.gloo_extra: dict[int, int] = {}  # row -> bytes gloo allocates inside that op (CPU runs only)
        self._pending_gloo = 0
        # The last collective's buffer, and per row its bytes once the step has freed it: what gloo's
        # worker may still hold there (see estimate.collective_race_bytes).
        self._recent: deque[tuple[Any, int]] = deque(maxlen=1)
        self.race: list[int] = []
        self.sharded_params: list[nn.Parameter] = []  # FSDP2's sharded parameters, whose .grad is reduce-scattered
        self.sharded_grads: list[int] = []
        self._shard_grads_set = False

    def _note_collective(self, func: Any, args: tuple[Any, ...]) -> None:
        c10d = torch.ops.c10d
        tensors: list[Any] = []
        if func is c10d._allgather_base_.default:
            tensors = [args[0]]
        elif func is c10d._reduce_scatter_base_.default:
            tensors = [args[1]]
            # gloo reduce-scatters through a full-size copy of the input, alive inside the op.
            self._pending_gloo = args[1].numel() * args[1].element_size()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self._comm[id(st)] = weakref.ref(st)
                self._recent.append((weakref.ref(st), st.nbytes()))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self._note_collective(func, args)
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]

    def _update_peak_stats(self, peak_state: Any) -> None:
        """Called after every tracked op: record one timeline row.

        MemTracker's own version also walks every module's statistics on every op
        (O(modules x ops): 54 of 76 s for a Llama-3-8B step); the planner needs only the
        timeline, so it is not called.
        """
        row = [0] * len(CATS)
        for dev, snap in self._curr_mem_snap.items():  # type: ignore[attr-defined]
            if dev.type != "cpu":
                continue
            for reftype, nbytes in snap.items():
                cat = category_of(reftype)
                if cat is not None:
                    row[CAT_INDEX[cat]] += nbytes
        for key, ref in list(self._comm.items()):
            st = ref()
            winfo = self._WINFO.get(st, (None, None))[0] if st is not None else None  # type: ignore[attr-defined]
            if winfo is None or winfo.device.type != "cpu":
                if st is None:
                    del self._comm[key]
                continue
            cat = category_of(winfo.reftype)
            if cat is not None and cat != "communication":
                row[CAT_INDEX[cat]] -= winfo.mem_consumed
                row[CAT_INDEX["communication"]] += winfo.mem_consumed
        if self.sharded_params:
            changed = self._shard_grads_set or not self.rows or self.rows[-1][CAT_INDEX["gradients"]] != row[CAT_INDEX["gradients"]]
            self.sharded_grads.append(self._sharded_grad_bytes() if changed else self.sharded_grads[-1])
            self._shard_grads_set = False
        if self._pending_gloo:
            self.gloo_extra[len(self.rows)] = self._pending_gloo
            self._pending_gloo = 0
        self.rows.append(tuple(row))
        self.race.append(max((nbytes for ref, nbytes in self._recent if ref() is None), default=0))
        self.phases.append(1 if torch._C._current_graph_task_id() != -1 else 0)
        parents = [p for p in self._mod_tracker.parents if p != "Global"]  # type: ignore[attr-defined]
        name = max(parents, key=len) if parents else ""
        idx = self._module_index.get(name)
        if idx is None:
            idx = self._module_index[name] = len(self.module_names)
            self.module_names.append(name)
        self.modules.append(idx)

    @property
    def race_after_backward(self) -> int:
        """What gloo may hold past the last op: FSDP2's root post-backward frees every buffer left."""
        return max((nbytes for _, nbytes in self._recent), default=0)

    def follow_sharded_grads(self, params: list[nn.Parameter]) -> list[Any]:
        """Record, per op, the bytes of these FSDP2 shards' gradients. FSDP2 calls a shard's
        post-accumulate-grad hooks right after it sets the shard's reduce-scattered `.grad`; that
        (or any change of the gradient bytes) is when they are counted again. An unsharded
        gradient freed and its shard set can leave the gradient bytes unchanged (bf16 unsharded,
        fp32 shards, world 2). Returns the hooks' handles."""
        self.sharded_params = params

        def mark(_: nn.Parameter) -> None:
            self._shard_grads_set = True

        return [p.register_post_accumulate_grad_hook(mark) for p in params]

    def _sharded_grad_bytes(self) -> int:
        """Bytes of the storages behind FSDP2's sharded gradients (a group's shards are views of one
        reduce-scatter output, counted once). `_local_tensor`, not `to_local()`: this runs inside the
        tracker's dispatch, where `to_local()` would dispatch a view op of its own."""
        storages: dict[int, int] = {}
        for p in self.sharded_params:
            grad = p.grad
            if grad is None:
                continue
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            st = local.untyped_storage()
            storages[st._cdata] = st.nbytes()
        return sum(storages.values())


def tracker_class() -> type:
    class Timeline(_Timeline, FrozenAwareMemTracker):
        def __init__(self) -> None:
            super().__init__()
            self._init_timeline()

    return Timeline


__all__ = ["CATS", "CAT_INDEX", "tracker_class"]
