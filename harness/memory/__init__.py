"""Memory techniques and memory measurement.

Techniques, each in its own module and applied in `harness.engine.parallelize` (tiled MLP ->
AC -> compile -> sharding): the tiled MLP, activation checkpointing, activation offload, torch.compile with an
activation-memory budget, optimizer-in-backward. Measurement: `StepMemoryTracker` (peak by
category per step) over torch's memory trackers. `categories` is the one vocabulary. `pinned`:
pinned host memory as torch's caching host allocator takes it (what the planner books).

To add a technique: a module here exposing `apply_<technique>(model, ...)`, a config key in
`harness.config.schema.MemoryConfig` with its rule in `harness.config.checks`, and one line
in `harness.engine.parallelize.apply_memory_techniques`.
"""

from harness.memory.activation_checkpoint import apply_activation_checkpointing, blocks_to_wrap, checkpointed_blocks, clean_fqn
from harness.memory.activation_offload import ActivationOffload
from harness.memory.categories import CATEGORIES, REPORTED, STATE_CATEGORIES, category_of
from harness.memory.compile import CompileTimer, apply_compile, set_activation_memory_budget
from harness.memory.optimizer_in_backward import OptimizerInBackward
from harness.memory.pinned import pinned_block, pinned_bytes
from harness.memory.tiled_mlp import apply_tiled_mlp, mlp_tiles, tiled_mlps
from harness.memory.tracking import (
    COUNTER_KEYS,
    AllocatorTrace,
    FrozenAwareMemTracker,
    ModelStorage,
    StepMemoryTracker,
    optimizer_state_bytes,
)

__all__ = [
    "AllocatorTrace",
    "COUNTER_KEYS",
    "CATEGORIES",
    "REPORTED",
    "STATE_CATEGORIES",
    "ActivationOffload",
    "CompileTimer",
    "FrozenAwareMemTracker",
    "ModelStorage",
    "OptimizerInBackward",
    "StepMemoryTracker",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_tiled_mlp",
    "blocks_to_wrap",
    "category_of",
    "checkpointed_blocks",
    "clean_fqn",
    "mlp_tiles",
    "optimizer_state_bytes",
    "pinned_block",
    "pinned_bytes",
    "set_activation_memory_budget",
    "tiled_mlps",
]
