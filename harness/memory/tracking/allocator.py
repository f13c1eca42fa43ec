"""The CPU allocator's own account of a run: every allocation and free, whoever made it.

torch's ``MemTracker`` is a dispatch mode: it sees the storages of the ops that pass through
torch's dispatcher and nothing below it, so a custom op's kernel (bitsandbytes' CPU 8-bit
update) and a tensor subclass's ``__torch_dispatch__`` (torchao's quantized optimizer states,
which dequantize and requantize inside it) allocate memory it never sees. And a dispatch mode
stops dynamo from compiling (torchao compiles its step with ``fullgraph=True``, which then
raises), so a step that compiles cannot be measured by it at all.

``torch.profiler`` with ``profile_memory=True`` records each allocation and free the allocator
makes ([memory] events, inside custom ops, subclasses and compiled kernels alike) without
changing what runs. :class:`AllocatorTrace` keeps that running sum from the moment it is
entered: entered before the model is built, its level at any instant is every byte the run
holds, and the largest level inside a marked window is that window's peak. Where both see
everything (torch's eager AdamW, torchao's bf16 moments), the two agree to a few bytes
(notes/optimizers.md). On a CUDA machine ``max_memory_allocated`` is the same truth, for free.

Cost: the profiler keeps one event per allocation and per op until it exits (a SmolLM2-135M
step: tens of thousands), so it is for measurement runs, not every training step.
"""

from __future__ import annotations

from time import time_ns
from types import TracebackType

from torch.profiler import ProfilerActivity, profile


class AllocatorTrace:
    """``with AllocatorTrace() as trace:`` ... ``trace.start_window()`` / ``trace.end_window()``
    around each step; after the block, :meth:`window_peaks` is each window's peak in bytes."""

    def __init__(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._windows: list[list[int]] = []
        self._peaks: list[int] | None = None

    def __enter__(self) -> AllocatorTrace:
        self._prof.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._windows and len(self._windows[-1]) == 1:
            self._windows[-1].append(time_ns())
        self._prof.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self._peaks = self._compute()

    def start_window(self) -> None:
        self._windows.append([time_ns()])

    def end_window(self) -> None:
        self._windows[-1].append(time_ns())

    def _compute(self) -> list[int]:
        events = sorted((e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
        peaks = [0] * len(self._windows)
        running = 0
        for e in events:
            running += e.nbytes()
            t = e.start_ns()
            for i, (start, end) in enumerate(self._windows):
                if start <= t <= end:
                    peaks[i] = max(peaks[i], running)
        # A window in which nothing was allocated or freed peaks at the level it started at.
        for i, (start, _) in enumerate(self._windows):
            if not peaks[i]:
                peaks[i] = sum(e.nbytes() for e in events if e.start_ns() < start)
        return peaks

    def window_peaks(self) -> list[int]:
        """Each marked window's largest running sum of allocations minus frees since entry, in bytes."""
        if self._peaks is None:
            raise RuntimeError("window_peaks() is read after the trace's block has exited")
        return list(self._peaks)


__all__ = ["AllocatorTrace"]
