"""Per-step peak memory by category (`StepMemoryTracker`) and the byte counts under it.

Modules: `step` (the tracker the trainer uses), `allocator` (the CPU allocator's own running account, for
measurement runs), `trackers` (torch's MemTracker/FSDPMemTracker
extended), `live` (direct byte counts: weakref-followed storages, optimizer state), `storage`
(`ModelStorage`: what the engine says about how it stores the model, so nothing here inspects
an engine's internals).
"""

from harness.memory.tracking.allocator import AllocatorTrace
from harness.memory.tracking.counters import COUNTER_KEYS, available_bytes
from harness.memory.tracking.live import is_compiled, optimizer_state_bytes, optimizer_tensors
from harness.memory.tracking.step import StepMemoryTracker
from harness.memory.tracking.storage import ModelStorage
from harness.memory.tracking.trackers import FrozenAwareMemTracker, write_module_report

__all__ = [
    "AllocatorTrace",
    "COUNTER_KEYS",
    "FrozenAwareMemTracker",
    "ModelStorage",
    "StepMemoryTracker",
    "available_bytes",
    "is_compiled",
    "optimizer_state_bytes",
    "optimizer_tensors",
    "write_module_report",
]
