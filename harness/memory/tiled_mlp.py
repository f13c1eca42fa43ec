"""Tiled MLP: each decoder block's MLP runs over sequence tiles, recomputed in backward.

At long sequence lengths the MLP's up-projection intermediates (gate, up, their product:
``micro_batch x seq x intermediate`` each, ~3.5x the hidden size in Llama) are the largest
activations of a block, and under full activation checkpointing they are what the
recomputation of one block materialises at once. Tiling cuts the sequence into ``n``
pieces; each piece runs through the MLP under torch's non-reentrant checkpoint, which keeps
only the piece's input for backward and recomputes the MLP when its backward needs it. The
intermediates then exist for one tile at a time, in forward and in backward: the MLP's
share of the activation peak is divided by ``n`` for the price of one more MLP forward.

The MLP is applied per position, so the tiled output and its gradients are those of the
untiled MLP (sums over the tiles in another order: equal to rounding).

Why not DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`` (ALST's,
the same idea; installed with DeepSpeed 0.19.8): its backward runs a nested
``torch.autograd.backward`` once per tile, so each weight's gradient is accumulated once
per tile (a post-accumulate-grad hook fires 4 times for 4 tiles, measured). ZeRO is told to
wait through its ``ds_grad_is_ready`` flag; harness's optimizer-in-backward, which steps a
parameter from that hook, would step on the first tile, and its own docstring leaves DDP and
FSDP "needing something similar". Checkpointing each tile leaves the step one graph: every
weight's gradient is summed over the tiles and accumulated once (the hook fires once), so
every engine sees the backward it expects, and the same checkpoint nests inside the
block-level activation checkpointing and compiles.

A mixture-of-experts block is tiled the same way (it routes each token alone); its router then runs
once per tile, and `harness.training.router` joins a layer's tiles back into one.

The module is changed from outside (its ``forward`` replaced on the instance): parameter
names, state dicts and checkpoints are those of the untiled model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.models import decoder_blocks
from harness.training import join_token_tiles

_TILED_ATTR = "_harness_mlp_tiles"


def mlp_tiles(seq_len: int, tiles: int = 0, tile_tokens: int = 0) -> int:
    """The number of sequence tiles for ``seq_len`` tokens: ``tiles`` or ``ceil(seq_len / tile_tokens)``,
    at most one tile per token; 1 means untiled."""
    if tiles and tile_tokens:
        raise ValueError("give the MLP's tile count or its tile size, not both")
    n = tiles if tiles else math.ceil(seq_len / tile_tokens) if tile_tokens else 1
    return max(1, min(n, seq_len))


def tiled_forward(forward: Callable[..., torch.Tensor], tiles: int, tile_tokens: int) -> Callable[..., torch.Tensor]:
    """``forward`` of an MLP (hidden states ``(..., seq, hidden)`` in, same shape out) run over sequence tiles."""

    def contiguous_forward(piece: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # A tile of a batch of rows is a strided view; a mixture-of-experts block flattens its
        # input with `view`. The copy is made inside the checkpoint: only the view is kept.
        return forward(piece.contiguous(), *args, **kwargs)

    @functools.wraps(forward)
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = mlp_tiles(x.shape[-2], tiles, tile_tokens)
        if n == 1:
            return forward(x, *args, **kwargs)
        pieces = x.chunk(n, dim=-2)
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for backward, tiling alone bounds the peak
            return join_tiles([contiguous_forward(p, *args, **kwargs) for p in pieces], pieces)
        return join_tiles([checkpoint(contiguous_forward, p, *args, use_reentrant=False, **kwargs) for p in pieces], pieces)

    return run


def join_tiles(outputs: list[Any], pieces: tuple[torch.Tensor, ...]) -> Any:
    """The tiles' outputs as the untiled MLP's: a tensor over the tile's positions `(..., tile,
    features)` joined along the positions; one over its flattened tokens `(rows x tile, ...)` (gpt-oss's
    router scores beside its output) joined back in (row, position) order; tuples element by element."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, tuple):
        return tuple(join_tiles([out[i] for out in outputs], pieces) for i in range(len(first)))
    tokens = pieces[0].shape[:-1]
    if first.shape[:-1] == tokens:
        return torch.cat(outputs, dim=-2)
    if first.dim() >= 1 and first.shape[0] == tokens.numel():
        return join_token_tiles(outputs, tokens[:-1].numel())
    raise ValueError(f"a tiled MLP returned a tensor of shape {tuple(first.shape)} for a tile of {tuple(tokens)} positions")


# The names transformers gives a decoder block's MLP: most families `mlp`; GraniteMoE, JetMoE and
# others their mixture of experts `block_sparse_moe`; Llama 4 `feed_forward`.
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward")


def block_mlp(block: nn.Module) -> nn.Module | None:
    """The decoder block's MLP (per position: what tiling may split), or None."""
    return next((m for name in MLP_NAMES if isinstance(m := getattr(block, name, None), nn.Module)), None)


def tiling_problem(model: nn.Module) -> str | None:
    """Why the tiled MLP cannot tile this model's decoder blocks (None: it can)."""
    if all(block_mlp(block) is not None for block in decoder_blocks(model)):
        return None
    return (
        f"memory.tiled_mlp: {type(model).__name__}'s decoder blocks hold no MLP by a name harness tiles "
        f"({', '.join(MLP_NAMES)}); set memory.tiled_mlp=0 and memory.tiled_mlp_tokens=0"
    )


def apply_tiled_mlp(model: nn.Module, tiles: int = 0, tile_tokens: int = 0) -> int:
    """Make every decoder block's MLP (`block_mlp`) run over sequence tiles, in place.

    ``tiles``: a fixed tile count; ``tile_tokens``: tokens per tile (the count follows the
    sequence). Apply before activation checkpointing, compile and sharding wrap the blocks.
    Returns the number of MLPs tiled.
    """
    if tiles < 0 or tile_tokens < 0 or bool(tiles) == bool(tile_tokens):
        raise ValueError(f"tiled MLP needs exactly one of a tile count or a tile size > 0 (got {tiles}, {tile_tokens})")
    if (problem := tiling_problem(model)) is not None:
        raise ValueError(problem)
    mlps = [block_mlp(block) for block in decoder_blocks(model)]
    for mlp in mlps:
        if getattr(mlp, _TILED_ATTR, None) is not None:
            raise ValueError("the MLPs of this model are already tiled")
        mlp.forward = tiled_forward(mlp.forward, tiles, tile_tokens)
        setattr(mlp, _TILED_ATTR, (tiles, tile_tokens))
    return len(mlps)


def tiled_mlps(model: nn.Module) -> int:
    """How many MLPs of ``model`` run tiled."""
    return sum(getattr(m, _TILED_ATTR, None) is not None for m in model.modules())


__all__ = ["MLP_NAMES", "apply_tiled_mlp", "block_mlp", "join_tiles", "mlp_tiles", "tiled_forward", "tiled_mlps", "tiling_problem"]
