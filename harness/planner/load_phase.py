"""What a rank holds while its model is built, sharded and filled (the load phase, before the
engine's state exists): the planner's account of `harness.engine.load_model`."""

from __future__ import annotations

from harness.planner.model_states import EngineSpec
from harness.planner.params import ParamInfo


def load_phase_bytes(espec: EngineSpec, info: ParamInfo) -> tuple[int, int]:
    """(device, host) bytes per rank while `harness.engine.load_model` builds and fills the model.

    Every path holds its own part of the working weights plus one tensor in flight: the
    checkpoint slice or seeded init of the tensor being filled, generated or read whole on
    the host at worst (fp32). FSDP2 shards on the meta device before allocating (a rank's
    shard); ZeRO-3's `zero.Init` creates each module's tensors whole on the device, then
    partitions them; ZeRO-0/1/2, DDP and single build the whole model in the working dtype.
    Parameter offload keeps the part on the host instead. At world > 1, `zero.Init` also
    broadcasts each new tensor from rank 0 before partitioning it, and the communication
    backend may still hold that tensor when `broadcast` returns (gloo's worker thread drops its
    reference when it next runs; NCCL's stream frees it when the copy completes): the previous
    tensor can still be whole while the next is built, two in flight (the race
    `collective_race_bytes` counts in the step; measured here: notes/ladder.md, "Three misses explained").
    """
    one_tensor = info.whole_largest * 4
    whole = info.total + info.frozen  # a LoRA model's frozen base is loaded like the rest
    # the working weights' dtype: DeepSpeed's half precision, bf16 module under single/DDP, FSDP2's fp32 shards
    half = ("bf16", "fp16") if espec.kind == "deepspeed" else ("bf16",) if espec.kind in ("single", "ddp") else ()
    working = 2 if espec.precision in half or espec.precision == "bf16_pure" else 4
    if espec.kind == "deepspeed" and espec.stage == 3:
        part, in_flight_device = whole * working // espec.world, one_tensor * (2 if espec.world > 1 else 1)
    elif espec.kind == "fsdp":
        part, in_flight_device = whole * working // espec.world, one_tensor // espec.world
    else:
        part, in_flight_device = whole * working, 0
    if espec.offload_params != "none":
        return in_flight_device, part + one_tensor
    return part + in_flight_device, one_tensor


__all__ = ["load_phase_bytes"]
