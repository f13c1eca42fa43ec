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
sequence) never exists; the causal mask is sdpa's `is_causal`. Packed examples (a run whose
data packs them: position ids that restart inside a row) are kept apart as transformers keeps
them at world 1: the group's position ids are all-gathered into the whole sequence's once per
forward, transformers' `find_packed_sequence_indices` numbers its examples, and sdpa gets the
block-diagonal causal mask (batch x 1 x S x S booleans, held from one forward to the backward's
recomputation). Other runs never gather nor check: no collective and no host sync added. The all-to-all is its own
inverse in layout, so its backward is the same exchange of the gradients (autograd through a
collective: each rank's backward delivers its loss's gradient to the ranks that computed the
inputs, so the group's gradients sum to those of the whole sequence).
"""

from __future__ import annotations

import functools
import weakref
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


class WholeSequenceMask:
    """The whole sequence's attention mask under a sequence group, made once per forward.

    Every decoder layer gets the same position-id tensor in a forward (and the same again in
    activation checkpointing's recomputation), so the mask is kept for the last tensor seen: one
    all-gather and one check for packing per forward, however many layers."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._key: Any = None
        self._mask: torch.Tensor | None = None

    def __call__(self, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """None (causal over the whole sequence: one example per row) or the (B, 1, S, S) boolean
        mask, True where a query may attend a key: causal and inside its own example."""
        if position_ids is None:
            return None
        if self._key is not None and self._key() is position_ids:
            return self._mask
        from transformers import masking_utils

        parts = [torch.empty_like(position_ids) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, position_ids.contiguous(), group=self.group)
        examples = masking_utils.find_packed_sequence_indices(torch.cat(parts, dim=-1))  # slices in rank order
        mask = None
        if examples is not None:
            total = examples.shape[-1]
            causal = torch.ones(total, total, dtype=torch.bool, device=examples.device).tril()
            mask = (examples[:, None, :, None] == examples[:, None, None, :]) & causal
        self._key, self._mask = weakref.ref(position_ids), mask
        return mask


def ulysses_sdpa(
    group: dist.ProcessGroup,
    whole_mask: WholeSequenceMask | None,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention function registered under `ULYSSES`: sdpa, causal over the whole sequence
    and, given a `WholeSequenceMask` (packed examples), inside each example."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise ValueError("Ulysses attention builds its own causal mask; a padding attention mask is not supported")
    mask = whole_mask(kwargs.get("position_ids")) if whole_mask is not None else None
    q, k, v = (sequence_to_heads(t, group) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    out, weights = sdpa_attention_forward(module, q, k, v, mask, is_causal=mask is None, **kwargs)
    return heads_to_sequence(out, group), weights


def attention_is_swappable(model: nn.Module) -> bool:
    """Whether the model's attention goes through transformers' registry and can run sdpa:
    otherwise a registered implementation is never called (eager-only models)."""
    return bool(getattr(model, "_supports_sdpa", False)) and type(model)._can_set_attn_implementation()


def use_ulysses(model: nn.Module, group: dist.ProcessGroup, packed: bool = False) -> None:
    """Register Ulysses attention over `group` and make it `model`'s (a peft model: its base's).
    `packed`: the run's rows pack several examples (`data.packing` of instruction data), which
    attention must keep apart; otherwise a row is one sequence and sdpa's `is_causal` is the mask."""
    from transformers import AttentionInterface

    mask = WholeSequenceMask(group) if packed else None
    AttentionInterface.register(ULYSSES, functools.partial(ulysses_sdpa, group, mask))
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    hf.set_attn_implementation(ULYSSES)
    if hf.config._attn_implementation != ULYSSES:  # a model that cannot switch (pre-flight refuses those)
        raise RuntimeError(f"{type(hf).__name__} did not take the Ulysses attention implementation")
