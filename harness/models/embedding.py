"""The input embedding's backward, summed in fp32 where torch's own kernel sums in the weight's dtype.

An embedding's weight gradient is a sum, per vocabulary row, over every token of the step that
reads that row. torch's CPU kernel (`embedding_dense_backward`) accumulates those sums in the
gradient's dtype: in bf16 each addition rounds to 8 bits relative to the running sum, so a row
read by n tokens carries an error growing with n (measured on Zipf token ids, against the same
bf16 inputs summed in fp32: 0.0037 / 0.016 / 0.068 at 512 / 8,192 / 131,072 tokens,
`notes/reliability.md`), where a sum rounded once stays near bf16's 2^-9. The frequent rows, the
ones every step moves most, are the worst. CUDA's kernel accumulates in fp32 (`acc_type`) and
rounds once; `Fp32SumEmbedding` makes the CPU do the same, and leaves every other case (fp32
weights, a GPU, the options that change the sum) to torch's own kernel.

Cost on the CPU path: an fp32 buffer of the table's shape and an fp32 copy of the incoming
gradient, for the length of the backward (on a CPU host, test-sized models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LOW_PRECISION = (torch.bfloat16, torch.float16)


class _Fp32SummedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.padding_idx = weight.shape[0], padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        padding = -1 if ctx.padding_idx is None else ctx.padding_idx
        if grad.device.type != "cpu" or grad.dtype not in LOW_PRECISION:
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.rows, padding, False), None
        flat_ids, flat_grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).float()
        if ctx.padding_idx is not None:  # the padding row takes no gradient, as torch's kernel
            flat_grad = flat_grad.masked_fill(flat_ids.eq(ctx.padding_idx).unsqueeze(-1), 0.0)
        summed = torch.zeros(ctx.rows, grad.shape[-1], dtype=torch.float32, device=grad.device)
        summed.index_add_(0, flat_ids, flat_grad)
        return None, summed.to(grad.dtype), None


class Fp32SumEmbedding(nn.Embedding):
    """An `nn.Embedding` whose weight gradient is summed in fp32 on a CPU (module docstring); the
    same parameters, names and forward."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.max_norm is not None or self.scale_grad_by_freq or self.sparse:  # torch's own semantics
            return super().forward(ids)
        return _Fp32SummedLookup.apply(ids, self.weight, self.padding_idx)


_SWAPPED: dict[type, type] = {}


def _fp32_sum_class(cls: type) -> type:
    """`Fp32SumEmbedding` for a plain embedding; for a subclass (Gemma's scaled embedding calls
    `super().forward` and scales it), the subclass with `Fp32SumEmbedding` beneath it."""
    if cls is nn.Embedding:
        return Fp32SumEmbedding
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(f"Fp32Sum{cls.__name__}", (cls, Fp32SumEmbedding), {"__module__": cls.__module__})
    return _SWAPPED[cls]


def sum_embedding_grads_in_fp32(model: nn.Module) -> int:
    """Give every embedding of `model` the fp32-summed backward in place (its class swapped:
    parameters, hooks and state-dict names stay); the number changed. A subclass whose forward
    does not call `nn.Embedding.forward` keeps its own lookup."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding) and not isinstance(module, Fp32SumEmbedding):
            module.__class__ = _fp32_sum_class(type(module))
            changed += 1
    return changed


__all__ = ["Fp32SumEmbedding", "sum_embedding_grads_in_fp32"]
