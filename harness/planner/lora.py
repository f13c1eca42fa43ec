"""LoRA and QLoRA in the planner: the decision tree's last two steps, in formulas.

When no full fine-tune fits - not with bf16, recomputation, a micro-batch of 1, ZeRO-3 or
offload - the decision tree (`harness.planner.recommend`) ends with LoRA, then QLoRA (the base
quantized to 8 or 4 bits).
What changes is model state only:

- the base is frozen: its parameters are held (bf16, or NF4 for QLoRA: 4 bits plus one 8-bit
  scale per 64 weights and one fp32 scale per 256 of those, double quantization) but it has
  no gradients and no optimizer state;
- the adapters (r x (in + out) per adapted linear) hold fp32 parameters, gradients and two
  Adam states: 16 bytes each (counted in fp32 even under bf16: an upper bound);
- activations are taken from the traced full fine-tune at the same precision, recomputation
  and micro-batch (`estimate`). A frozen linear no longer saves its input for a weight
  gradient, but its adapter does, so the traced value is an upper bound.

LoRA and NF4 QLoRA may shard the frozen base with FSDP2 at world > 1, which divides the
parameters by the world size (NF4: the codes; their scales stay whole on every rank,
`nf4_matrix_bytes`) and adds the all-gather buffers of one decoder block. Int8 QLoRA runs
under DDP (or one process) only.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.planner.estimate import Estimate
from harness.planner.trace import ParamInfo

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit weight, 8-bit absmax per 64, fp32 per 256 absmax blocks
BLOCKSIZE = 64  # bitsandbytes' 4-bit block (one 8-bit absmax each); its absmax are quantized again in blocks of 256
NF4_MODULE_BYTES = 4 + 16 * 4 + 256 * 4  # per quantized matrix: the absmax offset, the NF4 code book, the absmax code book (fp32)
INT8_BYTES = 1.0  # plus one fp32 scale per output row (added per matrix)
ADAPTER_STATE_BYTES = 16  # fp32 parameter + gradient + Adam's two states


@dataclass
class LoraPlan:
    """One rank's predicted peak for a LoRA/QLoRA run."""

    mode: str  # lora | nf4
    strategy: str  # ddp | fsdp
    world: int
    adapters: int  # adapter parameters (whole model)
    categories: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.categories.values())


def adapted(info: ParamInfo, targets: list[str] | None) -> list[tuple[str, tuple[int, ...]]]:
    """The weight matrices LoRA adapts: the decoder blocks' linears (the trainer's default) or the named modules."""
    out = []
    for name, shape in zip(info.names, info.shapes):
        parts = name.split(".")
        if len(shape) != 2 or parts[-1] != "weight" or len(parts) < 2:
            continue
        module = parts[-2]
        if (targets is None and ".layers." in f".{name}") or (targets is not None and module in targets):
            out.append((name, shape))
    return out


def adapter_numel(info: ParamInfo, targets: list[str] | None, r: int) -> int:
    return sum(r * (shape[0] + shape[1]) for _, shape in adapted(info, targets))


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


def base_bytes(info: ParamInfo, targets: list[str] | None, mode: str, dtype_bytes: int = 2, world: int = 1) -> int:
    """One rank's frozen base at FSDP2 `world` (1: replicated): quantized linears for QLoRA (every
    block linear: bitsandbytes quantizes all of them, whatever is adapted), the rest in the
    compute dtype (sharded by rows under FSDP2, as every parameter)."""
    if mode == "lora":
        return info.total * dtype_bytes // world
    quantized = adapted(info, None)
    q_numel = sum(s[0] * s[1] for _, s in quantized)
    rest = (info.total - q_numel) * dtype_bytes // world
    if mode == "nf4":
        return rest + sum(sum(nf4_matrix_bytes(s[0] * s[1], world, dtype_bytes)) for _, s in quantized)
    return rest + int(q_numel * INT8_BYTES) + sum(4 * s[0] for _, s in quantized)  # int8 is never sharded


def _block_bytes(info: ParamInfo, dtype_bytes: int) -> int:
    """The largest decoder block's parameter bytes (FSDP2 gathers one block at a time)."""
    blocks: dict[str, int] = {}
    for name, numel in zip(info.names, info.numels):
        parts = name.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts):
            key = ".".join(parts[: parts.index("layers") + 2])
            blocks[key] = blocks.get(key, 0) + numel
    return max(blocks.values(), default=0) * dtype_bytes


def lora_plan(
    info: ParamInfo, full: Estimate, *, mode: str, strategy: str, world: int, r: int, targets: list[str] | None = None, dtype_bytes: int = 2
) -> LoraPlan:
    """Per-rank peak of a LoRA (`mode="lora"`) or QLoRA (`"nf4"`, `"int8"`) run, with the
    activations of `full`, the traced full fine-tune at the same precision, AC and micro-batch."""
    shard = world if strategy == "fsdp" else 1
    adapters = adapter_numel(info, targets, r)
    base = base_bytes(info, targets, mode, dtype_bytes, world=shard)
    acts = max((m.categories.get("activations", 0) + m.categories.get("temporaries", 0) for m in full.moments), default=0)
    other = max((m.categories.get("other", 0) for m in full.moments), default=0)
    comm = 2 * _block_bytes(info, dtype_bytes) if strategy == "fsdp" and world > 1 else 0
    categories = {
        "parameters": base + 4 * adapters // shard,
        "gradients": 4 * adapters // shard,
        "optimizer_state": 8 * adapters // shard,
        "activations": acts,
        "communication": comm,
        "other": other,
    }
    return LoraPlan(mode, strategy, world, adapters, categories)


__all__ = ["ADAPTER_STATE_BYTES", "LoraPlan", "NF4_BYTES", "adapted", "nf4_matrix_bytes", "adapter_numel", "base_bytes", "lora_plan"]
