"""Precision policy: what dtype parameters, compute and the loss use in each mode.

bf16 casts the model (or lets the engine keep fp32 master weights: DeepSpeed's bf16
optimizer, FSDP2's MixedPrecisionPolicy); fp16 keeps fp32 weights with autocast and a
loss scaler; the loss is always computed in fp32 (see harness/training/loss.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from harness.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    mode: str  # fp32 | bf16 | fp16
    param_dtype: torch.dtype  # dtype the module's parameters are cast to before wrapping
    compute_dtype: torch.dtype  # dtype matmuls run in
    uses_scaler: bool  # fp16 only: GradScaler / DeepSpeed dynamic loss scale
    autocast: bool  # fp16 runs under autocast with fp32 weights

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
    if mode == "bf16" and not bf16_supported(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        raise ConfigError(f"precision=bf16 but {name} has no bf16 support; use precision=fp16 (loss scaling) or fp32")
    if mode == "fp32":
        return PrecisionPolicy("fp32", torch.float32, torch.float32, False, False)
    if mode == "bf16":
        param = torch.float32 if engine_kind in ("fsdp", "deepspeed") else torch.bfloat16
        return PrecisionPolicy("bf16", param, torch.bfloat16, False, False)
    if mode == "fp16":
        return PrecisionPolicy("fp16", torch.float32, torch.float16, True, engine_kind != "deepspeed")
    raise ConfigError(f"precision={mode!r} is not one of fp32, bf16, fp16")
