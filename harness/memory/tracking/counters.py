"""The peak counters read on every step: cheap enough to leave on.

The category split (a dispatch mode that sees every allocation) costs about as much as the
step it measures, so it runs on sampled steps only. What runs on *every* step is what the
platform counts for free, as torchtitan logs it:

- CUDA: the caching allocator's peaks since the step began (``max_memory_allocated``,
  ``max_memory_reserved``), reset at the start of each step.
- CPU (Linux): the process's resident-set high-water mark (``VmHWM``), reset at the start of
  each step by writing ``5`` to ``/proc/self/clear_refs``. It counts every resident page,
  including memory-mapped files (a safetensors checkpoint read in place), so it is an upper
  bound on what the step's tensors hold. Where the mark cannot be reset (no ``/proc``, or
  ``clear_refs`` not writable), the value is the process's lifetime peak, ``ru_maxrss``:
  ``resets_per_step`` says which one a run gets.

Cost, measured: one ``open``/``write`` and one read of a small ``/proc`` file per step.
"""

from __future__ import annotations

import os
import re
import resource
import sys

import psutil
import torch

CLEAR_REFS = "/proc/self/clear_refs"
STATUS = "/proc/self/status"
_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)
COUNTER_KEYS = ("device_allocated", "device_reserved", "host_rss")  # every key `PeakCounters.read` may return


class PeakCounters:
    """``reset()`` at a step's start, ``read()`` at its end: the step's peak as the platform counts it."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.resets_per_step = cuda or self._try_reset()

    @staticmethod
    def _try_reset() -> bool:
        try:
            with open(CLEAR_REFS, "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.resets_per_step:
            self.resets_per_step = self._try_reset()

    def read(self) -> dict[str, int]:
        """``device_allocated``/``device_reserved`` on CUDA; ``host_rss`` (bytes) on CPU."""
        if self.cuda:
            return {"device_allocated": torch.cuda.max_memory_allocated(), "device_reserved": torch.cuda.max_memory_reserved()}
        return {"host_rss": self._host_peak()}

    def _host_peak(self) -> int:
        if self.resets_per_step:
            try:
                with open(STATUS) as f:
                    match = _HWM.search(f.read())
                if match:
                    return int(match.group(1)) * 1024
            except OSError:
                pass
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def available_bytes(device: torch.device) -> int:
    """Free memory this rank may count on: the GPU's free memory, or the host's available memory
    shared by the node's local ranks (`LOCAL_WORLD_SIZE`)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(psutil.virtual_memory().available // max(1, local))
