"""Checkpoints: atomic saves, exact resume at any world size, and export to a Hugging Face directory.

`CheckpointManager` is handed the engine and never asks which one it has; `layout` is the
on-disk side (what pre-flight reads without building a model); `export` turns any
checkpoint into `from_pretrained`-loadable safetensors. `python -m harness.checkpoint <run>`
lists a run's checkpoints.
"""

from harness.checkpoint.export import consolidated_weights, export_hf
from harness.checkpoint.layout import (
    CheckpointMeta,
    adapter_dir,
    check_compatible,
    checkpoint_root,
    complete_checkpoints,
    later_checkpoints,
    latest_checkpoint,
    read_meta,
    resolve_checkpoint_path,
    resume_path,
    unreadable_as_checkpoint_error,
    verified_meta,
)
from harness.checkpoint.manager import CheckpointManager, ResumeState
from harness.checkpoint.outdir import check_export_target, export_target_refusal, is_harness_export
from harness.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMeta",
    "ResumeState",
    "adapter_dir",
    "check_compatible",
    "checkpoint_root",
    "complete_checkpoints",
    "consolidated_weights",
    "export_hf",
    "check_export_target",
    "export_target_refusal",
    "is_harness_export",
    "later_checkpoints",
    "latest_checkpoint",
    "read_meta",
    "resolve_checkpoint_path",
    "resume_path",
    "unreadable_as_checkpoint_error",
    "verified_meta",
]
