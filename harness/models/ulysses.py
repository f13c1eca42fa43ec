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
data packs them: position ids that restart inside a row) are kept apart: the group's position
ids are all-gathered into the whole sequence's once per forward, read on the host for where each
example starts, and sdpa runs causal over each example on its own (`attend_per_example`). No
S x S mask exists (at one process transformers builds one, batch x 1 x S x S booleans plus sdpa's
float copy: ~5 S^2 bytes, which under a split every rank would hold whole). Other runs never
gather nor read: no collective and no host sync added. The all-to-all is its own
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
from torch._subclasses.fake_tensor import is_fake

from harness.errors import ConfigError

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


TRACED_EXAMPLES = 2  # a planner's fake positions hold no values: its rows are taken as this many equal examples


class WholeSequenceExamples:
    """Where each packed example of the whole sequence starts and ends, found once per forward.

    Every decoder layer gets the same position-id tensor in a forward (and the same again in
    activation checkpointing's recomputation), so the spans are kept for the last tensor seen: one
    all-gather and one read on the host per forward, however many layers. A row whose positions
    never restart is one example (plain causal attention)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._key: Any = None
        self._spans: list[list[tuple[int, int]]] | None = None

    def __call__(self, position_ids: torch.Tensor | None) -> list[list[tuple[int, int]]] | None:
        """None (every row one example) or, per row, the (start, end) of each example."""
        if position_ids is None:
            return None
        if self._key is not None and self._key() is position_ids:
            return self._spans
        parts = [torch.empty_like(position_ids) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, position_ids.contiguous(), group=self.group)
        whole = torch.cat(parts, dim=-1)  # slices in rank order
        rows, total = whole.shape
        if is_fake(whole):
            width = -(-total // TRACED_EXAMPLES)
            spans = [[(a, min(a + width, total)) for a in range(0, total, width)]] * rows
        else:
            restarts = torch.diff(whole, dim=-1) != 1  # a position that does not follow its left neighbour starts an example
            spans = []
            for row in restarts.cpu():
                starts = [0, *(row.nonzero().flatten() + 1).tolist()]
                spans.append(list(zip(starts, [*starts[1:], total])))
        self._key, self._spans = weakref.ref(position_ids), None if all(len(r) == 1 for r in spans) else spans
        return self._spans


def attend_per_example(
    module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[list[tuple[int, int]]], **kwargs: Any
) -> torch.Tensor:
    """Causal sdpa inside each example of each row, in attention's output layout (batch, S, heads,
    dim): what a block-diagonal causal mask computes, without the (batch, 1, S, S) mask, and with
    the sum of the examples' squared lengths of work rather than S squared."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = []
    for b, row in enumerate(spans):
        parts = [
            sdpa_attention_forward(module, *(t[b : b + 1, :, s:e] for t in (q, k, v)), None, is_causal=True, **kwargs)[0] for s, e in row
        ]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def replicate_kv_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """(batch, kv_heads, slice, dim) with each key/value head repeated in place until the group of
    `n` ranks can share them (`n` a multiple of kv_heads, as DeepSpeed's Ulysses replicates them):
    rank j's query heads are then served by its share, the grouping of query heads per key/value
    head unchanged. Unchanged when `n` divides kv_heads. The backward sums the copies' gradients."""
    heads = x.shape[1]
    return x if heads % n == 0 else x.repeat_interleave(n // heads, dim=1)


class _HeadGroups:
    """The attention module as sdpa reads it, with the query heads per key/value head of this
    rank's share (fewer than the module's own when key/value heads were replicated)."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    @classmethod
    def of(cls, module: nn.Module, groups: int) -> Any:
        return module if getattr(module, "num_key_value_groups", groups) == groups else cls(module, groups)


class UlyssesCalls:
    """How many times the registered Ulysses attention ran: a model whose attention does not go
    through transformers' registry (a custom attention, a family that calls sdpa itself) would
    leave it at 0 and attend only within each rank's slice, silently. The engine reads it after
    its first training forward (`check_ran`)."""

    def __init__(self, degree: int) -> None:
        self.degree, self.count = degree, 0

    def check_ran(self, model: nn.Module) -> None:
        if self.count == 0:
            raise ConfigError(
                f"parallel.sequence={self.degree}: {type(model).__name__}'s forward ran no Ulysses exchange (its attention does "
                "not go through transformers' attention registry), so each rank would attend within its own slice only; "
                "set parallel.sequence=1"
            )


def ulysses_sdpa(
    group: dist.ProcessGroup,
    examples: WholeSequenceExamples | None,
    calls: UlyssesCalls,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention function registered under `ULYSSES`: sdpa, causal over the whole sequence
    or, given `WholeSequenceExamples` (packed rows), inside each example."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise ValueError("Ulysses attention builds its own causal mask; a padding attention mask is not supported")
    calls.count += 1
    spans = examples(kwargs.get("position_ids")) if examples is not None else None
    key, value = (replicate_kv_heads(t, dist.get_world_size(group)) for t in (key, value))
    q, k, v = (sequence_to_heads(t, group) for t in (query, key, value))
    module = _HeadGroups.of(module, q.shape[1] // k.shape[1])
    kwargs.pop("is_causal", None)
    if spans is not None:
        return heads_to_sequence(attend_per_example(module, q, k, v, spans, **kwargs), group), None
    out, weights = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
    return heads_to_sequence(out, group), weights


def attention_is_swappable(model: nn.Module) -> bool:
    """Whether the model's attention goes through transformers' registry and can run sdpa:
    otherwise a registered implementation is never called (eager-only models)."""
    return bool(getattr(model, "_supports_sdpa", False)) and type(model)._can_set_attn_implementation()


def use_ulysses(model: nn.Module, group: dist.ProcessGroup, packed: bool = False) -> UlyssesCalls:
    """Register Ulysses attention over `group` and make it `model`'s (a peft model: its base's).
    `packed`: the run's rows pack several examples (`data.packing` of instruction data), which
    attention must keep apart; otherwise a row is one sequence and sdpa's `is_causal` is the mask.
    Returns the count of its calls, which the engine checks after the first forward."""
    from transformers import AttentionInterface

    examples = WholeSequenceExamples(group) if packed else None
    calls = UlyssesCalls(dist.get_world_size(group))
    AttentionInterface.register(ULYSSES, functools.partial(ulysses_sdpa, group, examples, calls))
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    hf.set_attn_implementation(ULYSSES)
    if hf.config._attn_implementation != ULYSSES:  # a model that cannot switch (pre-flight refuses those)
        raise RuntimeError(f"{type(hf).__name__} did not take the Ulysses attention implementation")
    return calls
