"""The memory techniques as rows: each declared once, with what turns it on, what it costs in step
time, whether the out-of-memory advice suggests it, and (for those that rewrite the model) its place
in the order the model is prepared.

The memory ladder (`harness.planner.ladder`), the fastest-config search's step-time factors
(`harness.planner.candidates.step_time_factor`) and the out-of-memory advice
(`harness.reliability.oom`) read these rows; the engines and the planner's trace prepare the model
with `prepare_model`, which applies the rows in table order. A technique's config keys and their
refusals stay with the config (`harness.config.schema.MemoryConfig`, `harness.config.checks`),
which sits below this package.

Step-time factors are stated heuristics, relative to the step without the technique, not GPU
measurements (no GPU on the development machine). The tiled MLP runs one more MLP forward (~2/3 of a
block's linear FLOPs, a forward being ~1/4 of a checkpointed step): x1.20 measured on SmolLM2 at 1,152
tokens (CPU, AC + chunked loss, `benchmarks/knob_step_time.py`), less where attention's s^2 term
dominates. Checkpoint-input offload: x1.008 measured there (host to host, nothing overlapped); on a GPU
its copies overlap on a side stream (accelerate measured +0.6% on Qwen3-0.6B at 1M tokens).
Activation checkpointing's factors are per mode (`AC_STEP_TIME`: one more forward for full, less for
the modes that save more); the chunked loss recomputes nothing (1.0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from harness.config import MemoryConfig, RunConfig
from harness.memory.activation_checkpoint import apply_activation_checkpointing
from harness.memory.compile import apply_compile
from harness.memory.tiled_mlp import apply_tiled_mlp
from harness.models import sum_embedding_grads_in_fp32

LOSS_CHUNK = 1024  # tokens per chunk of the chunked loss: logits of 1024 positions at a time
MLP_TILE_TOKENS = 4096  # tokens per MLP tile: ALST's rule (tiles of hidden-size tokens) at Llama-3-8B's 4096
AC_STEP_TIME = {"none": 1.0, "op": 1.08, "selective": 1.15, "full": 1.33}


@dataclass(frozen=True)
class Technique:
    """One memory technique (see the module docstring)."""

    name: str  # the ladder's rung and the advice's words
    turn_on: tuple[tuple[str, Any], ...]  # the config values that turn it on at its default setting
    is_on: Callable[[MemoryConfig], bool]
    step_time: float = 1.0  # stated factor when on, relative to the step without it (activation checkpointing: per mode)
    apply: Callable[[nn.Module, MemoryConfig], None] | None = None  # rewrites the model (in `prepare_model`'s order)
    advise: Callable[[RunConfig, str], bool] | None = None  # the OOM advice suggests it (config, target) on long sequences

    def overrides(self) -> tuple[str, ...]:
        """`turn_on` as `key=value` overrides (the ladder's rung)."""
        return tuple(f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in self.turn_on)


def _tiles(mem: MemoryConfig) -> tuple[int, int]:
    return (mem.tiled_mlp if mem.tiled_mlp > 1 else 0, mem.tiled_mlp_tokens)


def _tiled_on(mem: MemoryConfig) -> bool:
    return any(_tiles(mem))


def _compiled(mem: MemoryConfig) -> bool:
    return mem.compile != "none" or mem.activation_memory_budget is not None


def _offload_advised(cfg: RunConfig, target: str) -> bool:
    """On a GPU only (on a CPU the host is the device), where the blocks are checkpointed and nothing
    else moves the saved tensors."""
    mem = cfg.memory
    return target == "cuda" and mem.activation_checkpointing != "none" and not mem.activation_offload and mem.compile == "none"


ACTIVATION_CHECKPOINTING = Technique(
    "activation checkpointing (every block)",
    (("memory.activation_checkpointing", "full"),),
    is_on=lambda m: m.activation_checkpointing != "none",
    step_time=AC_STEP_TIME["full"],
    apply=lambda model, m: apply_activation_checkpointing(model, m.activation_checkpointing, m.ac_every),
)
CHUNKED_LOSS = Technique(
    "chunked loss (no full logits)",
    (("memory.loss_chunk_size", LOSS_CHUNK),),
    is_on=lambda m: m.loss_chunk_size > 0,
)
TILED_MLP = Technique(
    "tiled MLP (its intermediates a tile at a time)",
    (("memory.tiled_mlp_tokens", MLP_TILE_TOKENS),),
    is_on=_tiled_on,
    step_time=1.2,
    apply=lambda model, m: apply_tiled_mlp(model, *_tiles(m)),
    advise=lambda cfg, target: cfg.data.seq_len > MLP_TILE_TOKENS,
)
CHECKPOINT_INPUT_OFFLOAD = Technique(
    "checkpoint-input offload (block inputs on the host)",
    (("memory.offload_checkpoint_inputs", True),),
    is_on=lambda m: m.offload_checkpoint_inputs,
    step_time=1.01,
    advise=_offload_advised,
)
COMPILE = Technique(
    "torch.compile (with an activation-memory budget)",
    (("memory.compile", "model"),),
    is_on=_compiled,
    apply=lambda model, m: apply_compile(model, m.compile if m.compile != "none" else "model", m.activation_memory_budget),
)

# The order the model is prepared in, for the engines and the planner's trace alike: the tiled MLP
# replaces the MLP's forward inside each block, activation checkpointing then wraps the blocks, and
# compile takes the wrapped model; sharding comes after, in each engine (torchtitan's order).
TECHNIQUES: tuple[Technique, ...] = (TILED_MLP, ACTIVATION_CHECKPOINTING, COMPILE, CHUNKED_LOSS, CHECKPOINT_INPUT_OFFLOAD)


def prepare_model(model: nn.Module, memory: MemoryConfig) -> None:
    """Apply every technique `memory` turns on that rewrites the model, in `TECHNIQUES`' order
    (before any sharding wraps the blocks). First, whatever is on: the embedding's weight gradient
    summed in fp32 on a CPU (`harness.models.embedding`; CUDA's kernel already does), so a bf16
    run's most-read rows are not rounded once per token."""
    sum_embedding_grads_in_fp32(model)
    for technique in TECHNIQUES:
        if technique.apply is not None and technique.is_on(memory):
            technique.apply(model, memory)


def advised(cfg: RunConfig, target: str) -> list[Technique]:
    """The long-sequence techniques the out-of-memory advice suggests for `cfg` (those not on yet), in table order."""
    return [t for t in TECHNIQUES if t.advise is not None and not t.is_on(cfg.memory) and t.advise(cfg, target)]
