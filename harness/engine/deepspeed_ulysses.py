"""Sequence parallelism under DeepSpeed: DeepSpeed's own Ulysses (ALST's `UlyssesSPAttentionHF`).

harness's trainer is the same under every engine: each rank of a sequence group reads its group's
samples and runs its slice (`harness.data.SequenceSlice`), with the whole sequence's position ids,
and its loss is its slice's summed token losses over the step's counted tokens per micro-batch and
rank. What differs is the engine's part: ALST swaps the model's sdpa attention for its all-to-all
wrapper (transformers' attention registry, process-wide), and DeepSpeed, given ALST's groups
(`mpu`), partitions and reduces over the whole world. How it averages differs by stage
(`alst_loss_divisor`); the engine divides the loss so that the step's gradient is the token mean
harness computes under every other engine.

ALST's attention discards every mask and runs sdpa causal over the gathered row, so packed
examples would attend to each other (the config checks refuse that combination).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from harness.distributed import DistInfo
from harness.errors import ConfigError


def alst_groups(model: nn.Module, degree: int, micro_batch_size: int, info: DistInfo) -> Any:
    """Register ALST's attention for `model` (built with sdpa) and make its sequence groups of
    `degree` consecutive ranks, the layout of harness's data x sequence mesh. Returns ALST's
    parallel-state module, which `deepspeed.initialize(mpu=...)` takes. Collective."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.comm.init_distributed(dist_backend=info.backend or "gloo", dist_init_required=False)
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention != "sdpa":
        raise ConfigError(
            f"parallel.sequence={degree} under DeepSpeed runs ALST over sdpa attention, and this model's is {attention!r}: "
            "set parallel.sequence=1 or use strategy=fsdp or ddp"
        )
    return UlyssesSPAttentionHF.register_with_transformers(
        model, "sdpa", sequence_parallel_size=degree, micro_batch_size=micro_batch_size, seq_length_is_variable=True
    )


def alst_loss_divisor(degree: int, zero_stage: int) -> int:
    """What the loss is divided by so that DeepSpeed's reduction gives the mean over the world.

    Measured on DeepSpeed 0.19.8 (2 and 4 gloo ranks, sequence groups of 2, each rank's gradient
    read with `safe_get_full_grad` against one process's): ZeRO-0, -1 and -2 divide the summed
    gradients by the data-parallel size (world / degree), i.e. they sum over a sequence group, so
    the loss is divided by the degree; ZeRO-3 divides by the whole world, as harness's loss expects."""
    return degree if degree > 1 and zero_stage < 3 else 1


class _NoTensorParallel:
    """ALST's parallel state as DeepSpeed's checkpoint IO must see it: no tensor parallelism.
    Without it, DeepSpeed takes ALST's sequence group for a tensor-parallel one there: the saved
    checkpoint declares `tp_degree` = the sequence degree beside one model file (its converter then
    refuses it), and the universal loader asks for a tensor-parallel size ALST's module does not
    have (AttributeError) and would load a slice of every parameter. Everything else is ALST's."""

    def __init__(self, mpu: Any):
        self._mpu = mpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mpu, name)

    @staticmethod
    def get_tensor_model_parallel_rank() -> int:
        return 0

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return 1


@contextlib.contextmanager
def checkpoint_io(ds_engine: Any) -> Iterator[None]:
    """Save or load a checkpoint under ALST as plain data-parallel ZeRO state (resumable at another
    sequence degree or world size): the engine's and the optimizer's `mpu` say "no tensor
    parallelism" for the IO only. Training keeps ALST's, whose model-parallel group (the sequence
    group) DeepSpeed reduces the gradient norm over."""
    holders = [h for h in (ds_engine, getattr(ds_engine, "optimizer", None)) if getattr(h, "mpu", None) is not None]
    saved = [h.mpu for h in holders]
    if not holders or any(hasattr(m, "get_tensor_model_parallel_world_size") for m in saved):
        yield
        return
    for holder, mpu in zip(holders, saved):
        holder.mpu = _NoTensorParallel(mpu)
    try:
        yield
    finally:
        for holder, mpu in zip(holders, saved):
            holder.mpu = mpu
