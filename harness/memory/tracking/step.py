"""Per-step peak memory by category: parameters, gradients, optimizer state, activations, ...

Users come because of OOM, so every run says *what* filled memory at its peak. Sources:

- Eager models: torch's ``MemTracker`` (``FSDPMemTracker`` for an FSDP2 root, whose
  all-gather / reduce-scatter buffers are the ``communication`` category). A dispatch
  mode sees every tensor allocation, so on CPU tensors the split is byte-exact. A fresh
  tracker per measured step (MemTracker refuses a second forward of the same root).
- Compiled models, and optimizers that compile their own step (torchao's): a dispatch mode
  makes dynamo skip compiled frames (torch.compile under a non-infra TorchDispatchMode runs
  eagerly; with ``fullgraph=True``, as torchao compiles, it raises), so MemTracker would
  measure the eager program or break it. Instead :class:`LiveBytes` follows storages by weakref: activations are what
  autograd saves (``saved_tensors_hooks``, which compiled graphs go through), gradients
  come from gradient hooks, parameters and optimizer state are counted. Temporaries,
  communication buffers and the common total are not seen there: those keys are absent.
- Every step, split or not: the platform's own peak counters (`counters.PeakCounters`):
  on CUDA ``max_memory_allocated`` / ``max_memory_reserved`` (``device_allocated`` /
  ``device_reserved``), on CPU the process's resident high-water mark (``host_rss``).
  They cost next to nothing; the split costs about a step, so it runs on steps 0 and 1
  (the second step's is what the planner predicts: under torch's optimizers the first holds no
  optimizer state before its own optimizer step creates it), every ``category_every``-th
  step after, and on the step after :meth:`StepMemoryTracker.request_split` (SIGUSR2 in a run).

Two views per step: :meth:`StepMemoryTracker.last_peaks` is the split *at the moment
the total peaked* (the stacked bar); :meth:`last_category_maxima` is each category's own
maximum over the step (what "cuts the gradient peak" means).

Attribution limits, measured: MemTracker labels a tensor by the phase that allocates it.
Optimizer-step temporaries count as optimizer state; under FSDP2 with
optimizer-in-backward each sharded gradient is consumed inside FSDP's post-backward before
it can be labelled, so it shows as a temporary. DeepSpeed: ZeRO's fp32 masters and Adam
state live in its optimizer wrapper, created before any per-step tracker, so they are
counted directly (:func:`optimizer_tensors`; ZeRO-3's partitions and masters as the engine's
``ModelStorage`` names them); ZeRO's
own flat gradient partitions and buckets appear as temporaries/activations, not gradients.
DDP: its C++ reducer allocates the gradient buckets at construction; with
``gradient_as_bucket_view`` the gradients are views of them, counted once a backward has
made them ``.grad`` (step 0 under-reports gradients; later steps are right).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from harness.distributed import local_tensor, unwrap
from harness.memory.categories import CATEGORIES
from harness.memory.tracking.counters import PeakCounters
from harness.memory.tracking.live import (
    LiveBytes,
    is_compiled,
    optimizer_state_bytes,
    optimizer_tensors,
    storages,
    tensor_bytes,
    torch_optimizers,
)
from harness.memory.tracking.storage import ModelStorage
from harness.memory.tracking.trackers import FSDPTracker, Tracker, in_backward, peaks, to_categories, write_module_report
from harness.models import decoder_blocks
from harness.training import compiles_step


class StepMemoryTracker:
    """Measure each training step's memory peaks by category; ``enabled=False`` costs nothing.

    ``with tracker.step(): forward, backward, optimizer step`` then :meth:`last_peaks`.
    ``category_every``: split by category on steps 0, 1 and every k-th after (0: steps 0
    and 1 only; the dispatch-mode tracker slows a step about two-fold), and on the step after
    :meth:`request_split`; the platform's peak counters on every step.
    ``snapshot_dir``: on step ``snapshot_step`` write a CUDA memory-history pickle
    (pytorch.org/memory_viz) or, on CPU, the per-module report as JSON (eager models).
    ``layer_hooks``: record the bytes held after each decoder block's forward (eager models).
    ``optimizer``: a torch optimizer, an OptimizerInBackward or a DeepSpeed ZeRO optimizer.
    ``storage``: how the engine stores the model, where a plain module would mislead
    (`harness.engine.Engine.memory_storage()`); default: a plain module.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        enabled: bool = True,
        *,
        category_every: int = 1,
        snapshot_dir: str | None = None,
        snapshot_step: int = 1,
        layer_hooks: bool = False,
        compiled: bool | None = None,
        storage: ModelStorage | None = None,
    ) -> None:
        self.model, self.optimizer, self.enabled = model, optimizer, enabled
        self.storage = storage or ModelStorage()
        self.category_every = category_every
        self.snapshot_dir, self.snapshot_step = snapshot_dir, snapshot_step
        self.compiled = is_compiled(model) if compiled is None else compiled
        # torchao's optimizers compile their own step, which a dispatch mode would break (see
        # `compiles_step`): such steps are split by LiveBytes like a compiled model's.
        self.step_compiled = any(compiles_step(o) for o in torch_optimizers(optimizer))
        if layer_hooks and enabled and self.compiled:
            # Hooks added to compiled modules each step would be traced and force recompiles.
            warnings.warn("memory layer hooks are a debug option for eager models; ignored for a compiled model", stacklevel=2)
        self.layer_hooks = layer_hooks and enabled and not self.compiled
        self.cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        self.history: list[dict[str, Any]] = []
        self.snapshot_path: str | None = None
        self.counters = PeakCounters(self.cuda)
        self._step_index = 0
        self._split_requested = False
        self._layer_bytes: list[dict[str, Any]] = []
        self._current: Any = None  # the active tracker or LiveBytes, for layer hooks

    # ------------------------------------------------------------------ measurement
    def _splits_this_step(self) -> bool:
        i, k = self._step_index, self.category_every
        return i < 2 or (k > 0 and i % k == 0) or self._split_requested

    def request_split(self) -> None:
        """Split the next step by category (safe from a signal handler: it only sets a flag)."""
        self._split_requested = True

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Measure everything run inside (micro-batches, backward, optimizer step) as one step."""
        if not self.enabled:
            yield
            return
        record: dict[str, Any] = {"step": self._step_index}
        snapshot = self.snapshot_dir is not None and self._step_index == self.snapshot_step
        self.counters.reset()
        if self.cuda and snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        hooks = self._install_layer_hooks() if self.layer_hooks else []
        split = self._splits_this_step()
        self._split_requested = False
        try:
            if not split:
                yield
            elif self.compiled or self.step_compiled:
                with self._live_step(record):
                    yield
            else:
                with self._dispatch_step(record, snapshot):
                    yield
        finally:
            for h in hooks:
                h.remove()
            self._current = None
        record.update(self.counters.read())
        if self.cuda:
            if snapshot:
                self.snapshot_path = os.path.join(self.snapshot_dir, f"memory_snapshot_step{self._step_index}.pickle")
                os.makedirs(self.snapshot_dir, exist_ok=True)
                torch.cuda.memory._dump_snapshot(self.snapshot_path)
                torch.cuda.memory._record_memory_history(enabled=None)
        if self._layer_bytes:
            record["layers"] = self._layer_bytes
            self._layer_bytes = []
        self.history.append(record)
        self._step_index += 1

    def _make_tracker(self) -> Any:
        if self.storage.sharded:
            return FSDPTracker(self.model, torch_optimizers(self.optimizer))
        tracker = Tracker()
        tracker.track_external(self.model, *torch_optimizers(self.optimizer))
        # Parameter storage the module does not show (ZeRO-3's partitions); ZeRO's fp32 master
        # partitions are parameters of the inner optimizer, not of the module.
        for t in self.storage.partitions():
            tracker._update_and_maybe_create_winfos(t, tracker._ref_class("Parameter"))
        for t in optimizer_tensors(self.optimizer, self.storage.masters()):
            if not any(st in tracker._WINFO for st in storages(t)):  # a ZeRO-3 fp32 master may be the parameter
                tracker._update_and_maybe_create_winfos(t, tracker._ref_class("Optstate"))
        return tracker

    @contextlib.contextmanager
    def _dispatch_step(self, record: dict[str, Any], snapshot: bool) -> Iterator[None]:
        tracker = self._make_tracker()
        self._current = tracker
        record["method"] = "dispatch"
        with warnings.catch_warnings():
            # MemTracker's grad hook warns when optimizer-in-backward already freed .grad.
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            with tracker:
                yield
        peak = tracker.get_tracker_snapshot("peak")
        device = self._device()
        record["peak"] = to_categories(peak.get(device, {}))
        record["detail"] = {getattr(k, "value", str(k)): v for k, v in peak.get(device, {}).items()}
        maxima: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        maxima.update({cat: v for (dev, cat), v in tracker.category_max.items() if dev == device})
        record["category_max"] = maxima
        record["detail_max"] = {getattr(k, "value", str(k)): v for (dev, k), v in tracker.raw_max.items() if dev == device}
        if device.type != "cpu" and torch.device("cpu") in peak:
            record["host_peak"] = to_categories(peak[torch.device("cpu")])
        if snapshot and self.snapshot_dir is not None and not self.cuda:
            self.snapshot_path = write_module_report(tracker, os.path.join(self.snapshot_dir, f"memory_report_step{self._step_index}.json"))

    @contextlib.contextmanager
    def _live_step(self, record: dict[str, Any]) -> Iterator[None]:
        acts, grads = LiveBytes(), LiveBytes()
        self._current = acts
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is not None:
                grads.add(p.grad)
        handles = []
        for p in params:
            handles.append(p.register_post_accumulate_grad_hook(lambda q: grads.add(q.grad) if q.grad is not None else None))
            if not self.storage.sharded:  # FSDP2 sharded params get no autograd gradient
                handles.append(p.register_hook(lambda g: grads.add(g)))

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, nn.Parameter) and not isinstance(getattr(t, "_base", None), nn.Parameter):
                acts.add(t)
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()
        maxima = {
            "parameters": tensor_bytes(self.model.parameters()),
            "model_buffers": tensor_bytes(self.model.buffers()),
            "gradients": grads.peak,
            "optimizer_state": optimizer_state_bytes(self.optimizer, self.model, self.storage),
            "activations": acts.peak,
        }  # temporaries, communication and the common total are not observable here: absent
        record["method"] = "saved-tensors"
        record["category_max"] = maxima
        record["peak"] = dict(maxima)  # no common instant is observable; each category's own peak

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            local = local_tensor(p)
            return torch.device(local.device.type, local.device.index) if local.device.type == "cuda" else local.device
        return torch.device("cpu")

    # ------------------------------------------------------------------ layer hooks
    def _current_bytes(self) -> int | None:
        if self.cuda:
            return torch.cuda.memory_allocated()
        tracker = self._current
        if isinstance(tracker, LiveBytes):
            return tracker.live
        if tracker is not None:
            return sum(snap.get("Total", 0) for snap in tracker.get_tracker_snapshot().values())
        return None

    def _install_layer_hooks(self) -> list[Any]:
        handles = []
        for i, block in enumerate(decoder_blocks(unwrap(self.model))):

            def pre(mod: nn.Module, args: Any, i: int = i) -> None:
                if torch.is_grad_enabled() and not in_backward():
                    self._layer_bytes.append({"block": i, "before": self._current_bytes()})

            def post(mod: nn.Module, args: Any, out: Any, i: int = i) -> None:
                if self._layer_bytes and self._layer_bytes[-1]["block"] == i and "after" not in self._layer_bytes[-1]:
                    entry = self._layer_bytes[-1]
                    entry["after"] = self._current_bytes()
                    if entry["before"] is not None and entry["after"] is not None:
                        entry["held"] = entry["after"] - entry["before"]

            handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
        return handles

    # ------------------------------------------------------------------ results
    def current(self) -> dict[str, int]:
        """Bytes per category right now, inside a category-split eager step (for debugging and tests)."""
        tracker = self._current
        if tracker is None or isinstance(tracker, LiveBytes):
            raise RuntimeError("current() needs an active eager step with the category split")
        return to_categories(tracker.get_tracker_snapshot().get(self._device(), {}))

    def last_peaks(self) -> dict[str, int | None]:
        """Bytes per category at the step's total peak, plus ``total`` (CUDA: also allocator peaks)."""
        return peaks(self.history[-1]) if self.history else {}

    def last_category_maxima(self) -> dict[str, int | None]:
        """Each category's own maximum during the last step."""
        return dict(self.history[-1].get("category_max", {})) if self.history else {}

    def last_layer_bytes(self) -> list[dict[str, Any]]:
        return list(self.history[-1].get("layers", [])) if self.history else []

    def peak_so_far(self) -> dict[str, int | None]:
        """Peaks of the step with the largest total so far (CUDA: largest allocator peak), with its index."""
        measured = [(peaks(r).get("device_allocated" if self.cuda else "total"), r) for r in self.history]
        measured = [(v, r) for v, r in measured if v is not None]
        if not measured:
            return {}
        rec = max(measured, key=lambda vr: vr[0])[1]
        return {**peaks(rec), "step": rec["step"]}
