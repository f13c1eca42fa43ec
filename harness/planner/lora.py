"""LoRA and QLoRA in the planner: the traced LoRA model, and the quantized base in formulas.

A LoRA run is planned like any run (`harness.planner.estimate`): the trace builds the model
the trainer trains - peft's adapters injected into the fake model, base frozen, in the
working dtype (`harness.planner.trace.build_fake_model`) - and runs its forward + backward
under the trainer's wrapping, AC and loss. So its activations are its own: a frozen linear
saves no input for a weight gradient (only its adapter's input and the rank-r product are
saved), which at Llama-3-8B, seq 2048, is ~13 GiB less than a full fine-tune's. Parameters,
gradients and optimizer state follow from the same trace: `ParamInfo` lists the trainable
parameters (the adapters) for the engine's formulas, and the frozen base separately.

QLoRA cannot be traced (fake tensors have no quantized storage), so its step is the traced
LoRA step with the parameter bytes it holds between steps replaced (:func:`quantized_base`;
what FSDP2 gathers on top stays traced), as the trainer holds them (`harness.models.qlora`):
every linear of the decoder blocks in NF4 (4-bit codes packed into a tensor of the compute
dtype, which FSDP2 shards by rows; the scales - one 8-bit absmax per 64 weights, one fp32 per
256 of those, the code books - whole on every rank: :func:`nf4_matrix_bytes`) or int8 (one byte
plus an fp32 scale per output row, never sharded); the rest of the base in its frozen dtype
(`PrecisionPolicy.frozen_dtype`: bf16 under FSDP2 bf16), sharded like any parameter; the
adapters in the engine's parameter dtype (fp32 masters under FSDP2, bf16 in a bf16 one-process
or DDP module, which the trainer casts). Activations are the traced LoRA model's, plus one
linear's weight dequantized in flight: NF4's is traced (`harness.planner.packed`: the packed
codes gathered, each weight dequantized for its matmul and dropped), int8's an upper bound
added by formula.
"""

from __future__ import annotations

import dataclasses
import math

from harness.memory import pinned_bytes
from harness.planner.fsdp_offload import in_flight_bytes, largest_group_shard
from harness.planner.model_states import EngineModel
from harness.planner.params import ParamInfo

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit weight, 8-bit absmax per 64, fp32 per 256 absmax blocks
BLOCKSIZE = 64  # bitsandbytes' 4-bit block (one 8-bit absmax each); its absmax are quantized again in blocks of 256
NF4_MODULE_BYTES = 4 + 16 * 4 + 256 * 4  # per quantized matrix: the absmax offset, the NF4 code book, the absmax code book (fp32)
INT8_BYTES = 1.0  # plus one fp32 scale per output row (added per matrix)


def quantized_linears(info: ParamInfo) -> list[tuple[str, tuple[int, ...]]]:
    """The frozen weight matrices bitsandbytes quantizes: every linear of the decoder blocks
    (transformers keeps the LM head in the compute dtype)."""
    return [
        (name, shape)
        for name, shape in zip(info.frozen_names, info.frozen_shapes)
        if len(shape) == 2 and name.endswith(".weight") and ".layers." in f".{name}"
    ]


def nf4_matrix_bytes(numel: int, world: int = 1, storage_bytes: int = 4) -> tuple[int, int]:
    """(codes, quantization state) bytes one rank holds of one NF4 matrix (bitsandbytes, double
    quantization). The codes (half a byte a weight, packed into elements of the compute dtype,
    `storage_bytes` each) are a tensor FSDP2 shards by rows, padded to a whole row per rank; the
    state (an 8-bit absmax per 64 weights, an fp32 absmax per 256 of those, the code books and
    offset) is held whole by every rank."""
    rows = (numel + 1) // (2 * storage_bytes)  # bitsandbytes' packed length, one code pair per byte
    codes = -(-rows // world) * storage_bytes
    blocks = -(-numel // BLOCKSIZE)
    state = blocks + 4 * -(-blocks // 256) + NF4_MODULE_BYTES
    return codes, state


def quantized_base_bytes(info: ParamInfo, mode: str, dtype_bytes: int = 4, world: int = 1) -> int:
    """One rank's frozen base of a QLoRA run at FSDP2 `world` (1: replicated): the quantized block
    linears, the rest in `dtype_bytes` (sharded by rows under FSDP2, as every parameter)."""
    quantized = quantized_linears(info)
    q_numel = sum(s[0] * s[1] for _, s in quantized)
    rest = (info.frozen - q_numel) * dtype_bytes // world
    if mode == "nf4":
        return rest + sum(sum(nf4_matrix_bytes(s[0] * s[1], world, dtype_bytes)) for _, s in quantized)
    return rest + int(q_numel * INT8_BYTES) + sum(4 * s[0] for _, s in quantized)  # int8 is never sharded


def quantized_base(
    em: EngineModel, info: ParamInfo, mode: str, shard: int = 1, dtype_bytes: int = 4, adapter_bytes: int = 4
) -> EngineModel:
    """The engine model of a traced LoRA step with QLoRA's parameter bytes (`shard`: ranks the
    base is divided over, 1 under DDP; `dtype_bytes`: what the rest of the base is held in;
    `adapter_bytes`: the adapters' dtype, the engine's parameter dtype). They replace the bytes
    the trace holds between steps only: what FSDP2 gathers on top (the unsharded embedding, head
    and packed codes of the groups running) stays the trace's. NF4: the trace already gathers
    the packed codes and dequantizes one weight at a time (`harness.planner.packed`); int8 (not
    traced as such): one dequantized bf16 linear in flight."""
    params = quantized_base_bytes(info, mode, dtype_bytes, shard) + adapter_bytes * info.total // shard
    resident = dict(em.resident)
    if mode != "nf4":
        largest = max((s[0] * s[1] for _, s in quantized_linears(info)), default=0)
        resident["temporaries"] = resident.get("temporaries", 0) + 2 * largest
    base = quantized_base_bytes(info, mode, dtype_bytes, shard)
    note = f"QLoRA ({mode}): base {base:,} B per rank by formula, activations of the traced LoRA model"
    if em.name == "fsdp+offload":
        return _offloaded_base(em, info, shard, dtype_bytes, adapter_bytes, note)
    return dataclasses.replace(em, params=None, params_held=params, end_params=params, resident=resident, notes=[*em.notes, note])


def _offloaded_base(em: EngineModel, info: ParamInfo, world: int, dtype_bytes: int, adapter_bytes: int, note: str) -> EngineModel:
    """An NF4 base under FSDP2's CPU offload: the codes, the rest of the base and the adapters are
    FSDP2's shards, on the host; the quantization state is the modules' own (not FSDP2's), on the
    device; the shards being copied in for their gathers (harness.planner.fsdp_offload) sized
    with the codes as they are packed."""
    quantized = dict(quantized_linears(info))
    shards, state = [], 0
    for name, shape in zip(info.frozen_names, info.frozen_shapes):
        if name in quantized:
            codes, scales = nf4_matrix_bytes(shape[0] * shape[1], world, dtype_bytes)
            shards.append((name, codes))
            state += scales
        else:
            shards.append((name, math.prod(shape) * dtype_bytes // world))
    shards += [(name, n * adapter_bytes // world) for name, n in zip(info.names, info.numels)]  # the adapters
    host = {**em.host, "parameters": pinned_bytes(b for _, b in shards)}  # pinned on the GPU run, one block a shard
    copied = in_flight_bytes(largest_group_shard(shards))
    resident = {**em.resident, "communication": copied}
    notes = [n for n in em.notes if not n.startswith("FSDP2 CPU offload")]  # its in-flight bytes were the unquantized shapes'
    notes.append(
        f"FSDP2 CPU offload: every shard on the host; on the device the quantization state ({state:,} B) "
        f"and {copied:,} B of shards copied in"
    )
    return dataclasses.replace(em, params=None, params_held=state, end_params=state, resident=resident, host=host, notes=[*notes, note])


__all__ = ["INT8_BYTES", "NF4_BYTES", "nf4_matrix_bytes", "quantized_base", "quantized_base_bytes", "quantized_linears"]
