"""The on-disk side of checkpoints: layout, metadata, atomic writes, finding the latest.

Kept apart from `harness.checkpoint.manager` (which talks to the engine) because pre-flight and
export need it without building a model: whether an output directory holds another run's
checkpoints, which checkpoint `resume=auto` means, and whether it can continue this run.

    <output_dir>/checkpoints/
      step_00000004/   a complete checkpoint: meta.json is written last, then the directory is renamed into place
      .tmp-step_…      a save in progress (or killed): never read, removed by the next run
      .trash-…         a checkpoint being deleted (renamed first, so a kill mid-delete leaves no partial step_…)
      latest           the name of the newest complete checkpoint, replaced atomically after each save
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from harness.config import CheckpointConfig, LoraConfig, ParallelLayout, RunConfig, Strategy, checkpoint_format
from harness.errors import CheckpointError, ConfigError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
FORMAT = 1


@dataclass
class CheckpointMeta:
    step: int
    world_size: int
    engine: str  # the checkpoint format (`harness.config.checkpoint_format`): "torch" (DCP) | "deepspeed"
    kind: str  # the engine kind (`harness.config.EngineKind`): single | ddp | fsdp | deepspeed
    strategy: str
    zero_stage: int
    global_batch: int
    model: str
    precision: str
    config: dict[str, Any]
    masks: str = "none"  # none | replicated | sharded
    kept_experts: dict[str, list[int]] = field(default_factory=dict)  # expert pruning's: MoE block -> the experts the export keeps
    files: dict[str, int] = field(default_factory=dict)  # every file's size, relative path -> bytes (empty: written before the manifest)
    format: int = FORMAT
    time: float = field(default_factory=time.time)


# ------------------------------------------------------------------ reading the directory


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def adapter_dir(output_dir: str) -> str:
    """Where a LoRA run leaves its PEFT adapter directory at the end."""
    return os.path.join(output_dir, "adapter")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def read_meta(path: str) -> CheckpointMeta:
    """The metadata of a complete checkpoint; CheckpointError if `path` is not one."""
    file = os.path.join(path, META)
    if not os.path.isfile(file):
        raise CheckpointError(f"'{path}' is not a complete checkpoint (no {META})")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        return CheckpointMeta(**data)
    except (ValueError, TypeError, OSError) as exc:
        raise CheckpointError(f"'{file}' is unreadable ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]})") from None


def file_sizes(directory: str) -> dict[str, int]:
    """Every file under `directory` (relative path -> bytes): the manifest a save records in meta.json."""
    sizes = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(parent, name)
            sizes[os.path.relpath(full, directory)] = os.path.getsize(full)
    return sizes


def verified_meta(path: str) -> CheckpointMeta:
    """The metadata of a checkpoint whose every file is present at the size it was written with
    (its manifest): a truncated, deleted or emptied file is named here, before any engine reads it."""
    meta = read_meta(path)
    for name, size in sorted(meta.files.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint '{path}' is incomplete: '{full}' is missing; {_ANOTHER}")
        found = os.path.getsize(full)
        if found != size:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: '{full}' has {found} bytes but was written with {size}; {_ANOTHER}")
    return meta


@contextlib.contextmanager
def unreadable_as_checkpoint_error(path: str) -> Iterator[None]:
    """Reading checkpoint `path`: any failure of the readers (torch.load's unpickler and zip reader,
    DCP, DeepSpeed's loaders) becomes one CheckpointError naming the checkpoint and the file where
    the reader says it. The manifest has already found every file at its written size, so the
    bytes are damaged or the reader cannot take them (a DeepSpeed loader refusing a layout): the
    line says both, not "corrupt", which would send a user to discard a sound checkpoint."""
    try:
        yield
    except (CheckpointError, ConfigError):
        raise
    except (Exception, CheckpointException) as exc:  # the readers raise anything from EOFError to KeyError (DCP: a BaseException)
        where = getattr(exc, "filename", None)
        what = f"'{where}'" if where else "a file of it"
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        detail = next((ln for ln in reversed(lines) if "Error" in ln), lines[0] if lines else "")[:200]  # DCP: the rank's last error line
        raise CheckpointError(
            f"checkpoint '{path}' could not be read: {what} failed ({type(exc).__name__}: {detail}); every file is there at its "
            f"written size, so its bytes are damaged or this reader cannot take them; {_ANOTHER}"
        ) from None


_ANOTHER = "resume from (or export) another checkpoint (python -m harness.checkpoint <run dir> lists them)"


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step_") and os.path.isfile(os.path.join(path, META)):
            try:
                found.append((read_meta(path).step, path))
            except CheckpointError:
                continue
    return sorted(found)


def latest_checkpoint(root: str) -> str | None:
    """The checkpoint `latest` names; if that pointer is missing or stale, the newest complete one."""
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if os.path.isfile(os.path.join(path, META)):
            return path
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def later_checkpoints(root: str, step: int, resumed: str) -> list[str]:
    """The complete checkpoints of the run in `root` later than `step`, when `resumed` is one of its own."""
    if not os.path.abspath(resumed).startswith(os.path.abspath(root) + os.sep):
        return []
    return [path for later, path in complete_checkpoints(root) if later > step]


def resolve_checkpoint_path(path: str) -> str:
    """A step directory, a `checkpoints/` directory or a run directory → a complete step directory."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    for root in (path, checkpoint_root(path)):
        found = latest_checkpoint(root)
        if found:
            return found
    raise CheckpointError(f"'{path}' holds no complete checkpoint (expected a step_* directory with {META}, or a run directory)")


def resume_path(checkpoint: CheckpointConfig, output_dir: str) -> str | None:
    """The checkpoint a run into `output_dir` resumes from: None for resume=none or a fresh resume=auto run."""
    resume = checkpoint.resume
    if resume in ("", "none"):
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoint_root(output_dir))
    if not os.path.exists(resume):
        raise ConfigError(f"checkpoint.resume='{resume}' does not exist; use auto, none or a checkpoint directory")
    return resolve_checkpoint_path(resume)


def check_compatible(
    meta: CheckpointMeta, path: str, cfg: RunConfig, strategy: Strategy, layout: ParallelLayout, model_shape: dict[str, Any] | None = None
) -> None:
    """Refuse a resume that could not continue the same run (before any process starts)."""
    if checkpoint_format(meta.kind) != checkpoint_format(strategy.kind):
        other = "a DeepSpeed strategy (zero1/zero2/zero3…)" if meta.kind == "deepspeed" else "ddp or fsdp"
        raise ConfigError(
            f"checkpoint '{path}' was written by {meta.strategy} ({meta.kind}); resume it with {other}, or start a new run "
            f"from its weights: python -m harness.export {path} --out <dir>, then model.name=<dir>"
        )
    if meta.model != cfg.model.name:
        raise ConfigError(f"checkpoint '{path}' is of model '{meta.model}' but model.name='{cfg.model.name}'")
    world = layout.data  # a sequence group reads one rank's samples
    global_batch = layout.global_batch(cfg.micro_batch_size, cfg.grad_accum)
    if meta.global_batch != global_batch:
        accum = meta.global_batch / (cfg.micro_batch_size * world)
        hint = f"set grad_accum={int(accum)}" if accum == int(accum) and accum >= 1 else "change micro_batch_size/grad_accum"
        raise ConfigError(
            f"checkpoint '{path}' was trained with global batch {meta.global_batch} but this run has {global_batch} "
            f"(micro_batch_size*grad_accum*data-parallel world = {cfg.micro_batch_size}*{cfg.grad_accum}*{world}); the data position would "
            f"not match: {hint}"
        )
    saved_split = meta.config.get("parallel", {}).get("sequence", 1)
    if cfg.data.streaming and (meta.world_size, saved_split) != (layout.world, layout.sequence):
        raise ConfigError(
            f"checkpoint '{path}' streamed its data at world size {meta.world_size} (parallel.sequence={saved_split}); a streamed "
            f"run resumes at that world size and split (each rank's position is in its own part of the stream), not "
            f"{layout.world} ({layout.sequence})"
        )
    for key in ("enabled", "r", "alpha", "target_modules", "target_parameters", "quantize"):  # a LoRA checkpoint holds only these adapters
        saved = meta.config.get("lora", {}).get(key, getattr(LoraConfig(), key))
        if saved != getattr(cfg.lora, key):
            raise ConfigError(
                f"checkpoint '{path}' was trained with lora.{key}={saved!r} but this run has {getattr(cfg.lora, key)!r}; "
                "resume with the same LoRA settings, or export it (--merged) and start a new run from that model"
            )
    own_bpe = ("vocab_size",) if not cfg.data.tokenizer and not os.path.isdir(cfg.model.name) else ()  # a locally trained BPE's size
    for key in ("seq_len", "source", "seed", "streaming", "tokenizer", *own_bpe):
        saved = meta.config.get("data", {}).get(key, getattr(cfg.data, key))
        if saved != getattr(cfg.data, key):
            raise ConfigError(f"checkpoint '{path}' was trained with data.{key}={saved!r} but this run has {getattr(cfg.data, key)!r}")
    if meta.kind == "deepspeed" and strategy.kind == "deepspeed" and meta.zero_stage != strategy.zero_stage:
        raise ConfigError(
            f"checkpoint '{path}' was written under ZeRO stage {meta.zero_stage} ({meta.strategy}) but this run uses stage "
            f"{strategy.zero_stage} ({strategy.name}); resume with strategy={meta.strategy}, or export it and start a new run from it"
        )
    check_same_architecture(meta, path, model_shape)


ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


def check_same_architecture(meta: CheckpointMeta, path: str, model_shape: dict[str, Any] | None) -> None:
    """The model directory's config.json (`model_shape`) must describe the architecture the
    checkpoint was trained as (the config.json in its `hf_config`): a directory edited in place
    would otherwise fail to load on every rank, or load into another shape."""
    saved_file = os.path.join(path, "hf_config", "config.json")
    if not model_shape or not os.path.isfile(saved_file):
        return
    try:
        with open(saved_file, encoding="utf-8") as f:
            saved = json.load(f)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"checkpoint '{path}' is corrupt: '{saved_file}' is unreadable ({type(exc).__name__})") from None
    for key in ARCHITECTURE_KEYS:
        if key in saved and key in model_shape and saved[key] != model_shape[key]:
            raise ConfigError(
                f"checkpoint '{path}' was trained with {key}={saved[key]!r} but model.name '{meta.model}' now has "
                f"{key}={model_shape[key]!r} (its config.json changed); resume with the model it was trained from"
            )


# ------------------------------------------------------------------ atomic writes


def write_json_atomic(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: str) -> None:
    """Rename, then delete: a kill mid-delete leaves a `.trash-…` directory, never a partial checkpoint."""
    if not os.path.exists(path):
        return
    parent, name = os.path.split(path.rstrip(os.sep))
    trash = os.path.join(parent, f".trash-{name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def read_file(file: str, weights_only: bool = False) -> Any:
    """torch.load of one file of a checkpoint; unreadable bytes are a CheckpointError naming the file."""
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # the unpickler and zip reader raise anything from EOFError to RuntimeError
        raise CheckpointError(
            f"checkpoint file '{file}' is corrupt ({type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}); {_ANOTHER}"
        ) from None


# ------------------------------------------------------------------ the manager
