"""Memory techniques and memory measurement.

Techniques, each in its own module and declared once as a row of `techniques.TECHNIQUES` (what
turns it on, its step-time factor, whether the OOM advice suggests it; `prepare_model` applies the
rows that rewrite the model in the table's order: tiled MLP -> AC -> compile, before sharding): the
tiled MLP, activation checkpointing, activation offload, torch.compile with an activation-memory
budget, optimizer-in-backward. Measurement: `StepMemoryTracker` (peak by
category per step) over torch's memory trackers. `categories` is the one vocabulary. `pinned`:
pinned host memory as torch's caching host allocator takes it (what the planner books).

To add a technique: a module here exposing `apply_<technique>(model, ...)`, its row in
`techniques.TECHNIQUES`, and a config key in `harness.config.schema.MemoryConfig` with its rule
in `harness.config.checks`.
"""

from harness.memory.activation_checkpoint import apply_activation_checkpointing, blocks_to_wrap, checkpointed_blocks, clean_fqn
from harness.memory.activation_offload import ActivationOffload
from harness.memory.categories import CATEGORIES, REPORTED, STATE_CATEGORIES, category_of
from harness.memory.compile import CompiledCheck, CompileTimer, apply_compile, set_activation_memory_budget
from harness.memory.optimizer_in_backward import OptimizerInBackward
from harness.memory.pinned import pinned_block, pinned_bytes
from harness.memory.techniques import (
    AC_STEP_TIME,
    ACTIVATION_CHECKPOINTING,
    CHECKPOINT_INPUT_OFFLOAD,
    CHUNKED_LOSS,
    COMPILE,
    LOSS_CHUNK,
    MLP_TILE_TOKENS,
    TECHNIQUES,
    TILED_MLP,
    Technique,
    advised,
    prepare_model,
)
from harness.memory.tiled_mlp import apply_tiled_mlp, mlp_tiles, tiled_mlps, tiling_problem
from harness.memory.tracking import (
    COUNTER_KEYS,
    AllocatorTrace,
    FrozenAwareMemTracker,
    ModelStorage,
    StepMemoryTracker,
    available_bytes,
    optimizer_state_bytes,
)

__all__ = [
    "AC_STEP_TIME",
    "ACTIVATION_CHECKPOINTING",
    "CHECKPOINT_INPUT_OFFLOAD",
    "CHUNKED_LOSS",
    "COMPILE",
    "LOSS_CHUNK",
    "MLP_TILE_TOKENS",
    "TECHNIQUES",
    "TILED_MLP",
    "Technique",
    "advised",
    "prepare_model",
    "AllocatorTrace",
    "COUNTER_KEYS",
    "CATEGORIES",
    "REPORTED",
    "STATE_CATEGORIES",
    "ActivationOffload",
    "CompileTimer",
    "CompiledCheck",
    "FrozenAwareMemTracker",
    "ModelStorage",
    "OptimizerInBackward",
    "StepMemoryTracker",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_tiled_mlp",
    "available_bytes",
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
    "tiling_problem",
]
