"""QLoRA's base as the trace needs it: each NF4 linear of the decoder blocks as what FSDP2 shards and
gathers of it, and what its forward and backward allocate.

The trainer's bitsandbytes ``Linear4bit`` holds its 4-bit codes packed into a tensor of the compute
dtype (``bnb_4bit_quant_storage``: two codes a byte, so a quarter of the weight's elements in bf16),
which FSDP2 shards by rows and all-gathers before the block runs: a quarter of the bytes a bf16
weight would gather. Its matmul (bitsandbytes' ``MatMul4Bit``) dequantizes the whole weight in the
compute dtype, uses it and drops it, in forward and again in backward for the input's gradient; it
saves no activation of its own (the LoRA adapter beside it saves the input). Fake tensors have no
quantized storage, so the traced model gets a stand-in with the same shapes and lifetimes.
"""

from __future__ import annotations

import torch
from torch import nn


class _DequantizedMatmul(torch.autograd.Function):
    """``x @ W.T`` with ``W`` made (dequantized) for the product and dropped, in forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codes: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        ctx.shape = (out_features, in_features)
        weight = x.new_empty(ctx.shape)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight = grad.new_empty(ctx.shape)
        return grad @ weight, None, None, None


class PackedLinear(nn.Module):
    """A frozen NF4 linear as the trainer holds it: its codes packed into ``dtype`` elements."""

    def __init__(self, base: nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        per_element = 2 * torch.empty((), dtype=dtype).element_size()  # codes per element of the storage
        rows = (base.in_features * base.out_features + per_element - 1) // per_element
        self.weight = nn.Parameter(torch.empty((rows, 1), dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantizedMatmul.apply(x, self.weight, self.out_features, self.in_features)


def pack_block_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace the frozen base linear of every decoder block's LoRA layer by its :class:`PackedLinear`
    (call inside the fake mode); the number replaced. transformers keeps the LM head unquantized."""
    count = 0
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if ".layers." in f".{name}." and type(base) is nn.Linear and not base.weight.requires_grad:
            module.base_layer = PackedLinear(base, dtype)
            count += 1
    return count


__all__ = ["PackedLinear", "pack_block_linears"]
