"""Where a causal LM keeps its repeated decoder blocks: the one lookup every technique uses.

Sharding (one FSDP2 unit per block), activation checkpointing (wrappers replace entries in
place), compile (per block), memory tracking (per-block hooks) and pruning (one unit per
block) all need the same answer, so it is given here once.
"""
from __future__ import annotations

from torch import nn


def decoder_block_list(model: nn.Module) -> nn.ModuleList:
    """The ``ModuleList`` holding the decoder blocks (wrappers replace its entries in place)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "transformer", None), "h", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}")
    return layers


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF causal LM (the unit of sharding and AC)."""
    return list(decoder_block_list(model))
