"""Activation checkpointing of HF decoder blocks, applied from outside the model.

Three modes trade recomputation for activation memory:

- ``full``: every decoder block is wrapped; only its inputs are kept for backward and the
  whole block is recomputed. Cheapest in memory, ~1 extra forward in compute.
- ``selective``: every k-th block is wrapped (torchtitan's layer-level SAC): a dial
  between no AC and full AC.
- ``op``: every block is wrapped with an op-level selective policy: the outputs of the
  expensive ops (matmuls, attention) are saved and everything cheap (norms, activations,
  rotary, elementwise) is recomputed. Most of the activation bytes of a Llama block are in
  those cheap ops' outputs, while most of the FLOPs are in the matmuls.

Blocks are wrapped with torch's ``checkpoint_wrapper`` (non-reentrant), replacing the
entry in the ``ModuleList``. We use a wrapper *module* rather than patching ``forward``
because (a) recomputation then goes through ``module.__call__`` so FSDP2 and MemTracker
hooks see it, (b) ``fully_shard`` can be applied to the wrapper afterwards (torchtitan's
order: AC, then compile, then FSDP), and (c) non-reentrant checkpoint passes the keyword
arguments HF blocks take (``position_embeddings=``, ``attention_mask=`` ...) untouched.
The wrapper adds ``_checkpoint_wrapped_module.`` to parameter FQNs; its state-dict hooks
and DCP's ``get_model_state_dict`` strip it, and `harness.models.clean_name` does it for the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from harness.config import AC_MODES
from harness.distributed import wrapper_chain
from harness.models import clean_name, decoder_block_list, decoder_blocks


def _matmul_ops() -> set[Any]:
    """The aten ops whose outputs the ``op`` policy saves (those present in this build).

    ``F.linear`` without bias lowers to ``mm`` (3-D inputs are flattened first), with bias
    to ``addmm``; attention scores go through ``bmm`` in eager attention or one of the
    SDPA kernels (CPU: ``_scaled_dot_product_flash_attention_for_cpu``).
    """
    aten = torch.ops.aten
    names = [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_mm",
    ]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def matmul_save_policy(ops: set[Any] | None = None) -> Callable[..., CheckpointPolicy]:
    """A SAC policy: MUST_SAVE the outputs of ``ops`` (default: matmuls and SDPA), recompute the rest.

    PREFER_RECOMPUTE (not MUST) for the rest lets torch.compile's partitioner keep a cheap
    op's output when that is better, as torchtitan does.
    """
    save = _matmul_ops() if ops is None else ops

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context_fn() -> tuple[Any, Any]:
    # A fresh pair of contexts per checkpointed call: the caching mode holds the saved
    # outputs of exactly one forward/recompute pair.
    return create_selective_checkpoint_contexts(matmul_save_policy())


def blocks_to_wrap(num_blocks: int, mode: str, every: int = 2) -> list[int]:
    """Indices of the blocks that ``mode`` checkpoints (``selective``: blocks k-1, 2k-1, ...)."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {', '.join(AC_MODES)}")
    if mode == "none":
        return []
    if mode == "selective":
        if every < 1:
            raise ValueError(f"ac_every={every} must be >= 1")
        return [i for i in range(num_blocks) if (i + 1) % every == 0]
    return list(range(num_blocks))


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> list[int]:
    """Wrap the HF decoder blocks of ``model`` for activation checkpointing, in place.

    Call before ``torch.compile`` and before ``fully_shard``/``deepspeed.initialize``.
    Returns the indices of the wrapped blocks (empty for ``none``).

    The KV cache is turned off (``config.use_cache = False``): a cache updated in forward
    would be updated a second time by the recomputation and corrupt attention.
    """
    indices = blocks_to_wrap(len(decoder_blocks(model)), mode, every)
    if not indices:
        return []
    layers = decoder_block_list(model)
    if any(isinstance(layers[i], CheckpointWrapper) for i in indices):
        raise ValueError("activation checkpointing is already applied to this model")
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    context_fn = _op_context_fn if mode == "op" else None
    for i in indices:
        kwargs: dict[str, Any] = {"preserve_rng_state": True}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
    return indices


def checkpointed_blocks(model: nn.Module) -> list[int]:
    """Indices of the decoder blocks currently wrapped by :func:`apply_activation_checkpointing`."""
    layers = decoder_block_list(model)
    return [i for i, block in enumerate(layers) if any(isinstance(m, CheckpointWrapper) for m in wrapper_chain(block))]


clean_fqn = clean_name  # a parameter name without the wrappers' segments (AC wrapper, torch.compile), as pruning names it


__all__ = [
    "apply_activation_checkpointing",
    "blocks_to_wrap",
    "checkpointed_blocks",
    "clean_fqn",
    "matmul_save_policy",
]
