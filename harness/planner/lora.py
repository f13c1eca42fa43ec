"""LoRA and QLoRA in the planner: the traced LoRA model, and the quantized base in formulas.

A LoRA run is planned like any run (`harness.planner.estimate`): the trace builds the model
the trainer trains - peft's adapters injected into the fake model, base frozen, in the
working dtype (`harness.planner.trace.build_fake_model`) - and runs its forward + backward
under the trainer's wrapping, AC and loss. So its activations are its own: a frozen linear
saves no input for a weight gradient (only its adapter's input and the rank-r product are
saved), which at Llama-3-8B, seq 2048, is ~13 GiB less than a full fine-tune's. Parameters,
gradients and optimizer state follow from the same trace: `ParamInfo` lists the trainable
parameters (the adapters) for the engine's formulas, and the frozen base separately.

QLoRA cannot be traced (bitsandbytes' kernels need a CUDA GPU, fake tensors have no
quantized storage), so its step is the traced LoRA step with the parameter bytes replaced
(:func:`quantized_base`): every linear of the decoder blocks in NF4 (4 bits, plus one 8-bit
absmax per 64 weights and one fp32 scale per 256 of those: double quantization) or int8
(one byte plus an fp32 scale per output row); the rest of the base in fp32, as
`peft.prepare_model_for_kbit_training` casts it; the adapters in fp32 (peft's
`autocast_adapter_dtype`; the trainer never casts a quantized model). Activations are the
traced bf16 LoRA model's, plus one linear's weight dequantized to bf16 in flight (an upper
bound: bitsandbytes frees it after each matmul).
"""

from __future__ import annotations

import dataclasses

from harness.planner.model_states import EngineModel
from harness.planner.trace import ParamInfo

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit weight, 8-bit absmax per 64, fp32 per 256 absmax blocks
INT8_BYTES = 1.0  # plus one fp32 scale per output row (added per matrix)


def quantized_linears(info: ParamInfo) -> list[tuple[str, tuple[int, ...]]]:
    """The frozen weight matrices bitsandbytes quantizes: every linear of the decoder blocks
    (transformers keeps the LM head in the compute dtype)."""
    return [
        (name, shape)
        for name, shape in zip(info.frozen_names, info.frozen_shapes)
        if len(shape) == 2 and name.endswith(".weight") and ".layers." in f".{name}"
    ]


def quantized_base_bytes(info: ParamInfo, mode: str) -> int:
    """The frozen base of a QLoRA run: quantized block linears, the rest in fp32."""
    quantized = quantized_linears(info)
    q_numel = sum(s[0] * s[1] for _, s in quantized)
    per = NF4_BYTES if mode == "nf4" else INT8_BYTES
    scales = 0 if mode == "nf4" else sum(4 * s[0] for _, s in quantized)
    return int(q_numel * per) + scales + (info.frozen - q_numel) * 4


def quantized_base(em: EngineModel, info: ParamInfo, mode: str, shard: int = 1) -> EngineModel:
    """The engine model of a traced LoRA step with QLoRA's parameter bytes (`shard`: ranks the
    base is divided over; 1 under DDP) and one dequantized bf16 linear in flight."""
    params = (quantized_base_bytes(info, mode) + 4 * info.total) // shard
    largest = max((s[0] * s[1] for _, s in quantized_linears(info)), default=0)
    resident = dict(em.resident)
    resident["temporaries"] = resident.get("temporaries", 0) + 2 * largest
    note = f"QLoRA ({mode}): base {quantized_base_bytes(info, mode):,} B quantized by formula, activations of the traced bf16 LoRA model"
    return dataclasses.replace(em, params=params, end_params=params, resident=resident, notes=[*em.notes, note])


__all__ = ["INT8_BYTES", "NF4_BYTES", "quantized_base", "quantized_base_bytes", "quantized_linears"]
