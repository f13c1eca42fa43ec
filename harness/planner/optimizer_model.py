"""The optimizer's part of a torch engine's model state: what it holds, where, and what its step adds.

Split from ``harness.planner.model_states`` (which lays these over each engine): the state bytes
are ``harness.training.optimizer_state_bytes`` (the one account, shared with the trainer's tests),
summed over a rank's local numels; here is what is on the device and what on the host (bitsandbytes'
paged states on a GPU), and the step's temporaries per element of the tensor being stepped, from
each library's code and measured on CPU (notes/optimizers.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.config import OPTIMIZER_LIBRARY, EngineKind
from harness.training import optimizer_shared_bytes, optimizer_state_bytes, optimizer_step_bytes


@dataclass(frozen=True)
class EngineSpec:
    """What decides model-state memory: engine, stage, offload, dtypes and DeepSpeed knobs."""

    kind: EngineKind  # harness.config.EngineKind: single | ddp | fsdp | deepspeed
    world: int
    precision: str  # fp32 | bf16 | fp16
    expert: int = 1  # ranks each MoE layer's experts are split over; FSDP2 shards each range over world / expert replicas
    stage: int = 0  # ZeRO stage (zero only)
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_params: str = "none"
    optimizer: str = "adamw"  # harness.config.OPTIMIZER_NAMES
    weight_decay: float = 0.0
    optimizer_in_backward: bool = False
    reduce_bucket: int = 500_000_000  # elements (DeepSpeed default 5e8)
    contiguous_gradients: bool = True
    persistence_threshold: int = 100_000
    max_live: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    nvme_buffer_count: int = 5
    nvme_buffer_size: int = 100_000_000
    target: str = "cuda"  # "cuda": device and host are separate; "cpu": the host is the device
    torch_param_bytes: int = 4  # single/DDP parameter dtype bytes (bf16 casts the module)
    frozen_param_bytes: int = 4  # a frozen parameter's bytes (PrecisionPolicy.frozen_dtype: FSDP2 bf16 holds it in bf16)
    compiled_step: bool = False  # torchao compiles its step (its default; `harness.training.name_compiles_step`)
    cpu_adam: bool | None = None  # DeepSpeedCPUAdam steps the offloaded optimizer (the engine plan's); None: by target
    # DeepSpeed's offload blocks' "pin_memory" (its default false): their host buffers pinned, each rounded by
    # torch's caching host allocator (harness.memory.pinned); FSDP2's CPU offload pins on a GPU always
    pin_optimizer: bool = False
    pin_params: bool = False


# torchao's step compiled by inductor on CPU (torch 2.13, torchao 0.18), bytes it allocates per element
# of the tensor being stepped, any weight dtype: the quantized states' dequantized moments as the fused
# kernels hand them on (8-bit: 8 B an element and 8 B a 256-element block; 4-bit: 26 B and 8 B a
# 128-element block); bf16 moments update in place (0). Measured by the allocator's events on one
# tensor (2048 x 256 and 1536 x 576: the same per element) and on SmolLM2-135M (notes/ladder.md).
TORCHAO_COMPILED_STEP = {"adamw_bf16": 0.0, "adamw_8bit": 8 + 8 / 256, "adamw_4bit": 26 + 8 / 128}

# bitsandbytes pages a state tensor (allocates it in CUDA managed memory) only when its parameter has at
# least this many elements (``Optimizer8bit.get_state_buffer``: ``p.numel() < 1e5`` stays a plain tensor).
BNB_PAGED_MIN = 100_000


def paged(spec: EngineSpec) -> bool:
    """bitsandbytes' paged optimizer on a GPU: its large 8-bit states live in CUDA unified memory,
    outside torch's allocator, and the driver evicts them to the host under pressure. On a CPU run
    there is no paging (bitsandbytes falls back to plain tensors): everything is counted as held."""
    return spec.target == "cuda" and OPTIMIZER_LIBRARY[spec.optimizer] == "bitsandbytes"


def paged_state_bytes(spec: EngineSpec, numels: list[int]) -> int:
    """The paged part of bitsandbytes' state: the two uint8 moments (``state1``/``state2``) of every
    tensor of >= ``BNB_PAGED_MIN`` elements. Its block absmax (fp32, one per 256), the code books and
    the smaller tensors' states are ordinary device tensors (``init_state``)."""
    return sum(2 * n for n in numels if n >= BNB_PAGED_MIN) if paged(spec) else 0


def torch_optimizer_bytes(spec: EngineSpec, numels: list[int]) -> int:
    """What a torch engine's optimizer holds *on the device* for tensors of these local numels, in the
    dtype the engine steps (``torch_param_bytes``): the states, bitsandbytes' code books once per
    optimizer object (one per parameter under optimizer-in-backward), and the per-tensor step
    counters where they are device memory (:func:`step_scalar_bytes`). A paged optimizer's paged
    states are not device memory held all step (:func:`paged_state_bytes`: the host's)."""
    dtype = torch.bfloat16 if spec.torch_param_bytes == 2 else torch.float32
    states = sum(optimizer_state_bytes(spec.optimizer, n, dtype) for n in numels)
    groups = [[n] for n in numels] if spec.optimizer_in_backward else [numels]
    shared = sum(optimizer_shared_bytes(spec.optimizer, group) for group in groups)
    return states - paged_state_bytes(spec, numels) + shared + step_scalar_bytes(spec, len(numels))


def step_transient_multiple(optimizer: str, weight_decay: float, fused: bool) -> int:
    """Temporaries of torch's step, in units of the largest tensor stepped (in its dtype; the torch
    engines' figure is ``torch_step_transient``). The torch engines build Adam/AdamW fused
    (``harness.training.build_optimizer``): in place, none (measured with MemTracker, with and
    without weight decay). DeepSpeed is handed the single-tensor loop (``fused=False``): two at
    ``denom = exp_avg_sq.sqrt() / bias_correction2_sqrt``, one more for Adam (not W) with weight
    decay (``grad + wd * param``); SGD's loop makes one with weight decay."""
    if optimizer in ("adam", "adamw"):
        return 0 if fused else 2 + (1 if optimizer == "adam" and weight_decay else 0)
    return 1 if weight_decay else 0  # SGD: grad.add(param, alpha=wd)


def step_bytes_per_element(spec: EngineSpec) -> float:
    """Temporaries of a torch engine's step, per element of the tensor being stepped.

    torchao's step compiled (its default, unless dynamo is off) on a CPU target:
    `TORCHAO_COMPILED_STEP`, measured; inductor fuses most of what the eager step below allocates.
    Compiled for a GPU it is not measured here, so a CUDA plan keeps the eager figures, an upper bound.

    torchao's ``single_param_adam`` works in fp32 whatever the weights' dtype. Run eager (as on CPU) it
    holds at most 6 fp32 copies of the tensor with fp32 weights (the decayed weight, both moments
    in fp32, the denominator, the scaled first moment and its quotient: 24 bytes an element) and,
    with bf16 weights, the fp32 gradient as well plus the stochastic rounding's int32 random bits,
    fraction, truncation, sum and result and a bool mask (41 bytes). The 8-bit and 4-bit states
    dequantize and requantize inside their tensor subclass's dispatch, which adds fp32 and int
    temporaries of their own: 53 bytes an element in all with fp32 weights, 57 with bf16 ones. All
    measured on CPU by the allocator's own events (notes/optimizers.md: torch's MemTracker does not
    see allocations inside a subclass's or a custom op's kernel). On a GPU torchao compiles the
    step (as on CPU, above), which may fuse most of these away: there the figures are an upper bound. bitsandbytes on a
    GPU updates in place in one fused kernel; what its step adds to the device is the paged working
    set, the two uint8 moments of the tensor being stepped, which ``step`` prefetches to the GPU
    (``prefetch_state``) before updating (the others may stay evicted on the host). bitsandbytes on
    CPU (its Python kernel in
    ``bitsandbytes.backends.cpu.ops``, below torch's dispatch modes) dequantizes both moments to fp32, copies the gradient (times its
    norm scale) and, for a non-fp32 weight, the weight to fp32, and divides ``sqrt(v)`` by the bias
    correction: 5 fp32 copies alive at the division (6 with a bf16 weight)."""
    library = OPTIMIZER_LIBRARY[spec.optimizer]
    if library == "torchao" and spec.compiled_step and spec.target == "cpu":
        return TORCHAO_COMPILED_STEP[spec.optimizer]
    if library == "torchao":
        fp32_weights = spec.torch_param_bytes == 4
        if spec.optimizer == "adamw_bf16":
            return 24 if fp32_weights else 41
        return 53 if fp32_weights else 57
    if library == "bitsandbytes":
        if paged(spec):
            return 2
        return (5 + (spec.torch_param_bytes != 4)) * 4 if spec.target == "cpu" else 0
    return step_transient_multiple(spec.optimizer, spec.weight_decay, fused=True) * spec.torch_param_bytes


def torch_step_transient(spec: EngineSpec, largest: int) -> int:
    """Temporaries of a torch engine's step for its largest (local) tensor (:func:`step_bytes_per_element`)."""
    if paged(spec) and largest < BNB_PAGED_MIN:
        return 0  # nothing is paged: the states are device tensors, counted as held
    return math.ceil(step_bytes_per_element(spec) * largest)


def step_scalar_bytes(spec: EngineSpec, tensors: int) -> int:
    """The per-tensor ``step`` counters (4-byte scalars): the torch engines' fused Adam keeps them on
    the parameter's device; DeepSpeed's single-tensor torch Adam and torchao's on the host (device
    memory only when the device is the CPU); DeepSpeed's CPU Adam counts in a Python int."""
    fused_on_device = spec.optimizer in ("adam", "adamw") and spec.kind != "deepspeed"
    on_device = spec.target == "cpu" or fused_on_device
    return optimizer_step_bytes(spec.optimizer) * tensors if on_device else 0


def paged_host(spec: EngineSpec, numels: list[int]) -> dict[str, int]:
    """Host bytes of a paged optimizer: its paged states, all of them (the driver may keep any part on
    the GPU while memory is free; under pressure it evicts them here, so the host must hold them)."""
    n = paged_state_bytes(spec, numels)
    return {"optimizer_state": n} if n else {}


def paged_notes(spec: EngineSpec, numels: list[int], largest: int) -> list[str]:
    n = paged_state_bytes(spec, numels)
    if not n:
        return []
    return [
        f"paged optimizer: {n:,} B of 8-bit states in CUDA unified memory counted on the host; the device holds their "
        f"absmax and the step's working set (one tensor's states, {torch_step_transient(spec, largest):,} B at most); paging not measured"
    ]


__all__ = [
    "BNB_PAGED_MIN",
    "EngineSpec",
    "TORCHAO_COMPILED_STEP",
    "paged",
    "paged_host",
    "paged_notes",
    "paged_state_bytes",
    "step_bytes_per_element",
    "step_scalar_bytes",
    "step_transient_multiple",
    "torch_optimizer_bytes",
    "torch_step_transient",
]
