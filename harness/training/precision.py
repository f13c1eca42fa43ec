"""Precision policy: what dtype parameters, compute and the loss use in each mode.

bf16 casts the model (or lets the engine keep fp32 master weights: DeepSpeed's bf16
optimizer, FSDP2's MixedPrecisionPolicy); fp16 keeps fp32 weights with autocast and a
loss scaler; the loss is always computed in fp32 (see harness/training/loss.py). bf16_pure
casts the weights to bf16 under every torch engine, FSDP2's sharded parameters included, and
keeps no fp32 master anywhere: only an optimizer that rounds its update into bf16
stochastically keeps such weights moving (``BF16_WEIGHT_OPTIMIZERS``; the config checks refuse
the others).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from harness.errors import ConfigError

# The one table of dtype names: a precision's, a statistic's or a reduction's name (`fp32`, `bf16`,
# `fp16`) and the torch dtype it stands for, both ways, and its bytes per element.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class PrecisionPolicy:
    mode: str  # fp32 | bf16 | fp16 | bf16_pure
    param_dtype: torch.dtype  # dtype the module's parameters are cast to before wrapping
    compute_dtype: torch.dtype  # dtype matmuls run in
    uses_scaler: bool  # fp16 only: GradScaler / DeepSpeed dynamic loss scale
    autocast: bool  # fp16 runs under autocast with fp32 weights

    @property
    def master_weights(self) -> str:
        """What the banner and the plan say about the weights the optimizer steps."""
        if self.mode == "bf16_pure":
            return "bf16 weights, no fp32 master"
        if self.param_dtype == torch.bfloat16:  # precision=bf16 under one process/DDP casts the module
            return "bf16 weights (the module is cast), no fp32 master"
        return "fp32 master weights" if self.mode in ("bf16", "fp16") else "fp32 weights"

    @property
    def frozen_dtype(self) -> torch.dtype:
        """The dtype a frozen parameter (a LoRA base) is held in. It takes no step, so it needs no
        master copy: where the engine casts every parameter to the compute dtype itself (FSDP2's
        mixed precision: fp32 shards, bf16 all-gathers), a frozen one is held in that dtype,
        what it computes in anyway, rounded as the cast would round it: the same forward and
        backward, half the bytes. Elsewhere (autocast, a cast module, fp32) the parameter dtype."""
        if not self.autocast and self.param_dtype != self.compute_dtype:
            return self.compute_dtype
        return self.param_dtype

    def autocast_context(self, device: torch.device):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def cast_inputs(self, tensor: torch.Tensor) -> torch.Tensor:
        """Floating inputs follow the compute dtype; token ids (integers) are left alone."""
        if tensor.is_floating_point() and tensor.dtype != self.compute_dtype:
            return tensor.to(self.compute_dtype)
        return tensor


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True  # CPU kernels implement bf16 (slowly, but correctly)


def precision_policy(mode: str, device: torch.device, engine_kind: str) -> PrecisionPolicy:
    """The policy for a precision mode on a device under an engine (ddp | fsdp | deepspeed).

    FSDP2 and DeepSpeed keep fp32 master weights themselves, so the module stays fp32 for
    them; single-process/DDP bf16 casts the module (the Peak Memory study's bf16 row).
    """
    if mode in ("bf16", "bf16_pure") and not bf16_supported(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        raise ConfigError(f"precision={mode} but {name} has no bf16 support; use precision=fp16 (loss scaling) or fp32")
    if mode == "fp32":
        return PrecisionPolicy("fp32", torch.float32, torch.float32, False, False)
    if mode == "bf16":
        param = torch.float32 if engine_kind in ("fsdp", "deepspeed") else torch.bfloat16
        return PrecisionPolicy("bf16", param, torch.bfloat16, False, False)
    if mode == "bf16_pure":  # no engine keeps an fp32 copy: the sharded/replicated weights are bf16
        return PrecisionPolicy("bf16_pure", torch.bfloat16, torch.bfloat16, False, False)
    if mode == "fp16":
        return PrecisionPolicy("fp16", torch.float32, torch.float16, True, engine_kind != "deepspeed")
    raise ConfigError(f"precision={mode!r} is not one of fp32, bf16, fp16, bf16_pure")
