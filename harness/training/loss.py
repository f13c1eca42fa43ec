"""Causal-LM loss in fp32 that never keeps a full fp32 logits tensor around.

The logits are the largest activation of a small-hidden / large-vocabulary LM: B*S*V
values, and HF's loss upcasts them to fp32 and lets ``log_softmax`` save an fp32 copy
for backward. Two variants, both equal to HF's ``ForCausalLMLoss`` (labels shifted
inside, ``-100`` ignored, mean over counted tokens):

- ``chunk_size == 0``: the model returns logits as usual; a fused cross-entropy upcasts
  a block of rows at a time and computes the loss *and its gradient* in forward, keeping
  only the gradient, in the logits' dtype, for backward (HF keeps an fp32 ``log_softmax``
  and creates two more fp32 logits-sized tensors in backward): as many bytes held as HF
  in fp32, half as many in bf16, and one to two logits-sized tensors less at the peak.
- ``chunk_size > 0``: the model body runs to the final hidden states and, for each chunk
  of ``chunk_size`` tokens (over the flattened batch*sequence axis), ``lm_head`` + fp32
  upcast + fused cross-entropy run in a checkpointed region. No B*S*V tensor exists at
  any time; at most one chunk's logits (chunk_size*V) live, in forward and in backward.
  The price is one more ``lm_head`` matmul per chunk in backward (the recomputation).

A loss from here supports one backward (no ``retain_graph`` second pass): the saved
gradient is scaled in place.

The chunked variant must run *inside* the root module's forward: FSDP2 unshards the
root's parameters (embeddings, final norm, ``lm_head``) only around that call, and a
DeepSpeed engine or DDP wrapper only forwards through ``module.__call__``. So a small
forward override is installed on the HF module's *instance* (class code untouched): with
the ``harness_targets`` keyword it returns the loss sum, without it it is the original
forward. The override is one stable bound method, so torch.compile guards stay valid.

A mixture-of-experts model's router loss (`harness.training.router`) rides every loss here: given a
`router` that has attached to the model, a training forward (gradients on) also asks the model for
its router logits (the chunked forward returns them beside its sum) and adds the router's term.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.distributed import unwrap
from harness.training.router import RouterLoss

IGNORE_INDEX = -100
_ORIG_FORWARD = "_harness_original_forward"


def shift_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets for next-token prediction: position t predicts labels[t+1]; the last position is ignored."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def _blockwise_ce(logits: torch.Tensor, targets: torch.Tensor, rows: int, grad: torch.Tensor | None) -> torch.Tensor:
    """Summed fp32 CE over ``rows``-row blocks; with ``grad``, also write softmax - onehot into it.

    Only one block is ever upcast to fp32, by ``log_softmax`` itself (one fused kernel: the
    block's log-probabilities, whose ``exp`` is the softmax). The logits are only read. The
    gradient is written *unscaled* (entries in [-1, 1]) so that fp16 can hold it; the
    1/token-count and loss-scaler factors are applied in backward, where autograd's own
    cross-entropy would apply them before its fp16 cast.

    The targets' masks are made once for all rows, so a block costs only its own arithmetic
    (its ops run once per block: on a small model they are a visible part of a step).
    """
    valid = (targets != IGNORE_INDEX).unsqueeze(1)
    safe = torch.where(valid, targets.unsqueeze(1), 0)  # an ignored row picks column 0, weighted 0
    weight = valid.to(torch.float32)  # 1 counted, 0 ignored: multiplies exactly like the bool mask
    minus_weight = -weight
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    blocks = zip(logits.split(rows), safe.split(rows), weight.split(rows), minus_weight.split(rows))
    grads = grad.split(rows) if grad is not None else itertools.repeat(None)
    for (block, picks, w, minus_w), g_out in zip(blocks, grads):
        logp = torch.log_softmax(block, dim=-1, dtype=torch.float32)
        total -= (logp.gather(1, picks) * w).sum()
        if g_out is not None:
            g = logp.exp_()  # softmax, in logp's memory
            g.scatter_add_(1, picks, minus_w)
            torch.mul(g, w, out=g_out)  # masked and cast into the gradient in one op
    return total


class _FusedCrossEntropy(torch.autograd.Function):
    """scale * summed fp32 cross-entropy whose gradient is computed in forward.

    Autograd's ``cross_entropy`` saves the fp32 ``log_softmax`` (4 bytes per logit) and
    its backward creates two more logits-sized fp32 tensors. Here forward computes loss
    and ``softmax - onehot`` block by block and keeps that gradient in the logits' dtype:
    backward only scales it, in place. No full fp32 tensor ever exists, the logits are not
    kept, and the held bytes are one logits-sized tensor in the model's dtype.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, scale: float | torch.Tensor, rows: int) -> torch.Tensor:
        grad = torch.empty_like(logits)
        total = _blockwise_ce(logits, targets, rows, grad)
        ctx.save_for_backward(grad)
        ctx.scale, ctx.used = scale, False
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.used:
            raise RuntimeError("causal_lm_loss: a second backward through the same loss (retain_graph) is not supported")
        ctx.used = True
        (grad,) = ctx.saved_tensors
        # In place: a scaled copy would be one more logits-sized tensor at the backward peak.
        return grad.mul_(grad_out * ctx.scale), None, None, None


def _rows_per_block(rows: int, vocab: int) -> int:
    # At most ~16M fp32 values (64 MiB) per block, and at least 8 blocks, so the fp32
    # temporaries stay a small fraction of the logits whatever their size.
    return max(1, min((1 << 24) // max(1, vocab), -(-rows // 8)))


def ce_sum(logits: torch.Tensor, targets: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """scale * summed fp32 cross-entropy of ``logits`` (any leading shape) against ``targets``
    (``-100`` ignored): the unchunked loss of every run, public for a caller holding its own logits.
    Under autograd its gradient is made in forward, block by block, in the logits' dtype: no
    logits-sized fp32 tensor exists at any time (`_FusedCrossEntropy`)."""
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    rows = _rows_per_block(flat.shape[0], flat.shape[-1])
    if not (torch.is_grad_enabled() and flat.requires_grad):  # evaluation: no gradient to prepare
        return _blockwise_ce(flat, flat_targets, rows, None) * scale
    return _FusedCrossEntropy.apply(flat, flat_targets, scale, rows)


def _head_ce_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ce_sum(head(hidden), targets)


def chunked_ce_sum(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Sum over tokens of fp32 CE(head(hidden), targets), ``chunk_size`` tokens at a time.

    Each chunk is a non-reentrant checkpoint: only the chunk's hidden slice (a view of
    ``hidden``) and targets are saved; its logits are recomputed in backward.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_hidden.shape[0], chunk_size):
        end = start + chunk_size
        total = total + checkpoint(_head_ce_sum, head, flat_hidden[start:end], flat_targets[start:end], use_reentrant=False)
    return total


def _forward_with_loss(
    self: nn.Module, *args: Any, harness_targets: torch.Tensor | None = None, harness_chunk_size: int = 0, **kwargs: Any
) -> Any:
    """The installed forward: the original one, or (with ``harness_targets``) body + chunked loss sum."""
    if harness_targets is None:
        return getattr(self, _ORIG_FORWARD)(*args, **kwargs)
    body = self.get_decoder()
    head = self.get_output_embeddings()
    if body is None or head is None:
        raise TypeError(f"{type(self).__name__} has no decoder/output embeddings; chunked loss needs an HF causal LM")
    out = body(*args, **kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    total = chunked_ce_sum(hidden, head, harness_targets, harness_chunk_size)
    return (total, out.router_logits) if kwargs.get("output_router_logits") else total


def install_loss_forward(model: nn.Module) -> nn.Module:
    """Install the chunked-loss forward on the HF module inside ``model`` (idempotent); returns that module.

    Call it before torch.compile of the whole model so the compiled graph includes it;
    :func:`causal_lm_loss` installs it lazily otherwise.
    """
    hf = unwrap(model)
    if _ORIG_FORWARD not in hf.__dict__:
        hf.__dict__[_ORIG_FORWARD] = hf.forward
        hf.forward = types.MethodType(_forward_with_loss, hf)
    return hf


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    chunk_size: int = 0,
    attention_mask: torch.Tensor | None = None,
    num_items: float | torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    router: RouterLoss | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 of ``model`` on ``input_ids``; same value as HF's loss.

    ``model`` is whatever the trainer calls: the HF model, an FSDP2 root, a DDP wrapper or
    a DeepSpeed engine. ``labels`` defaults to ``input_ids`` (shifted inside; ``-100`` is
    ignored). ``num_items``: divide the summed loss by this count instead of this batch's
    token count, so that gradient accumulation over micro-batches of uneven token counts
    equals one big batch (HF's ``num_items_in_batch``). ``position_ids`` restarting inside a
    row (packed examples) with no ``attention_mask``: transformers confines attention to each
    example. ``router``: a mixture-of-experts model's load-balancing term, added in training
    (`harness.training.router`).
    """
    targets = shift_targets(input_ids if labels is None else labels)
    return loss_of_targets(model, input_ids, targets, chunk_size, attention_mask, num_items, position_ids, router)


def loss_of_targets(
    model: nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 0,
    attention_mask: torch.Tensor | None = None,
    num_items: float | torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    router: RouterLoss | None = None,
) -> torch.Tensor:
    """`causal_lm_loss` against targets already shifted (position t predicts ``targets[t]``)."""
    kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    routed = router is not None and router.active and torch.is_grad_enabled()
    if routed:
        kwargs["output_router_logits"] = True
    denom = (targets != IGNORE_INDEX).sum() if num_items is None else num_items
    if chunk_size > 0:
        install_loss_forward(model)
        out = model(**kwargs, harness_targets=targets, harness_chunk_size=chunk_size)
        loss, router_logits = out if routed else (out, None)
        loss = loss / denom
    else:
        out = model(**kwargs)
        logits = out.logits if hasattr(out, "logits") else out[0]
        router_logits = out.router_logits if routed else None
        del out  # the logits are not needed after the loss: let them go
        loss = ce_sum(logits, targets, scale=1.0 / denom)
    if routed:
        assert router is not None
        term = router(router_logits, attention_mask)
        if term is not None:
            loss = loss + term
    return loss


def labelled_lm_loss(
    model: nn.Module,
    batch: torch.Tensor,
    chunk_size: int = 0,
    num_items: float | torch.Tensor | None = None,
    router: RouterLoss | None = None,
) -> torch.Tensor:
    """The loss of `(B, 3, S)` blocks of (input_ids, labels, position_ids) - instruction data
    (`harness.data.instructions`), where labels are -100 on prompt tokens and padding and
    positions restart with every packed example - summed over the labelled tokens and divided
    by ``num_items`` (default: this micro-batch's labelled count). `(B, 2, S)` blocks have no
    positions (one sequence per row). A micro-batch without one labelled token (a prompt
    longer than the block) contributes 0, not 0/0."""
    input_ids, labels = batch[:, 0].contiguous(), batch[:, 1].contiguous()
    positions = batch[:, 2].contiguous() if batch.shape[1] > 2 else None
    if num_items is None:
        num_items = (shift_targets(labels) != IGNORE_INDEX).sum().clamp(min=1)
    return causal_lm_loss(model, input_ids, labels, chunk_size=chunk_size, num_items=num_items, position_ids=positions, router=router)


def sequence_shard_loss(
    model: nn.Module,
    batch: torch.Tensor,
    chunk_size: int = 0,
    num_items: float | torch.Tensor | None = None,
    router: RouterLoss | None = None,
) -> torch.Tensor:
    """The loss of this rank's slice of every sample under sequence parallelism: `(B, 3, L+1)`
    blocks of (input_ids, labels, position_ids) over its L tokens plus the next slice's first
    (`harness.data.sampling.SequenceSlice`), whose label is the slice's last target and whose
    input is never fed. Positions are the whole sequence's. Summed over the slice's counted
    tokens and divided by ``num_items`` (default: their count): the trainer's count over all
    ranks is then the whole samples' count, each token counted once."""
    input_ids, positions = batch[:, 0, :-1].contiguous(), batch[:, 2, :-1].contiguous()
    targets = shift_targets(batch[:, 1])[:, :-1].contiguous()
    if num_items is None:
        num_items = (targets != IGNORE_INDEX).sum().clamp(min=1)
    return loss_of_targets(model, input_ids, targets, chunk_size=chunk_size, num_items=num_items, position_ids=positions, router=router)


def loss_for(sliced: bool, labelled: bool) -> Callable[..., torch.Tensor]:
    """The trainer's loss for its blocks: a rank's slice where the layout splits sequences (text or
    instruction alike), labelled `(B, 3, S)` instruction blocks, or `(B, S)` text."""
    return sequence_shard_loss if sliced else labelled_lm_loss if labelled else causal_lm_loss


def count_targets(batch: torch.Tensor) -> int:
    """The tokens a batch's loss counts: every next-token target of `(B, S)` text blocks, the
    labelled ones of `(B, 3, S)` (input_ids, labels, position_ids) blocks. The denominator that weights every
    counted token of a step equally, however the step is split into micro-batches and ranks."""
    labels = batch[:, 1] if batch.dim() == 3 else batch
    return int((shift_targets(labels) != IGNORE_INDEX).sum())


__all__ = [
    "IGNORE_INDEX",
    "causal_lm_loss",
    "ce_sum",
    "count_targets",
    "labelled_lm_loss",
    "loss_of_targets",
    "sequence_shard_loss",
    "chunked_ce_sum",
    "install_loss_forward",
    "shift_targets",
]
