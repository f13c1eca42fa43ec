"""Ulysses sequence parallelism inside an HF model's attention (DeepSpeed-Ulysses' layout).

Each rank of a sequence group holds a slice of every sample's sequence, with all heads. Around
attention, one all-to-all turns that into the whole sequence for a share of the heads, sdpa
runs causal attention over the whole sequence, and a second all-to-all turns the result back.
Everything else in the model (embeddings, MLPs, norms, the loss) sees only its slice, so every
activation but attention's is 1/N the size. Rotary embeddings are applied before the swap, from
the position ids of the whole sequence that each rank is given for its slice.

The hook is transformers' own attention registry: a function registered under `ULYSSES`
and set as the model's attention implementation. transformers builds no mask for an
implementation it has no mask function for, so the local slice's mask (wrong for the whole
sequence) never exists; the causal mask is sdpa's `is_causal`. The all-to-all is its own
inverse in layout, so its backward is the same exchange of the gradients (autograd through a
collective: each rank's backward delivers its loss's gradient to the ranks that computed the
inputs, so the group's gradients sum to those of the whole sequence).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ULYSSES = "harness_ulysses"


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()  # the collective reads and writes flat memory: `empty_like` of a strided view would keep its strides
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` over dim 0 (chunk j goes to rank j) with the same exchange as backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, heads, slice, dim) on each rank -> (batch, heads/N, N*slice, dim): this rank's
    share of the heads over the whole sequence (slices in rank order)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # send[j]: rank j's share of the heads
    recv = _AllToAll.apply(send, group)  # recv[j]: rank j's slice of this rank's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, N*slice, heads/N, dim), attention's output layout -> (batch, slice, heads, dim)."""
    n = dist.get_world_size(group)
    b, total, h, d = x.shape
    send = x.reshape(b, n, total // n, h, d).transpose(0, 1)  # send[j]: rank j's slice
    recv = _AllToAll.apply(send, group)  # recv[j]: rank j's heads for this rank's slice
    return recv.permute(1, 2, 0, 3, 4).reshape(b, total // n, n * h, d)


def ulysses_sdpa(
    group: dist.ProcessGroup,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention function registered under `ULYSSES`: sdpa, causal over the whole sequence."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise ValueError("Ulysses attention builds its own causal mask; an attention mask (padding, packed examples) is not supported")
    q, k, v = (sequence_to_heads(t, group) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    out, weights = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
    return heads_to_sequence(out, group), weights


def attention_is_swappable(model: nn.Module) -> bool:
    """Whether the model's attention goes through transformers' registry and can run sdpa:
    otherwise a registered implementation is never called (eager-only models)."""
    return bool(getattr(model, "_supports_sdpa", False)) and type(model)._can_set_attn_implementation()


def use_ulysses(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Register Ulysses attention over `group` and make it `model`'s (a peft model: its base's)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES, functools.partial(ulysses_sdpa, group))
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    hf.set_attn_implementation(ULYSSES)
    if hf.config._attn_implementation != ULYSSES:  # a model that cannot switch (pre-flight refuses those)
        raise RuntimeError(f"{type(hf).__name__} did not take the Ulysses attention implementation")
