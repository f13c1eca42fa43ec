"""Where a causal LM keeps its repeated decoder blocks: the one lookup every technique uses.

Sharding (one FSDP2 unit per block), activation checkpointing (wrappers replace entries in
place), compile (per block), memory tracking (per-block hooks) and pruning (one unit per
block) all need the same answer, so it is given here once.

The answer comes from the model's own metadata, not from attribute paths: transformers
lists, on every model class, the module classes that must never be split across devices
(`_no_split_modules`), and for a causal LM that is its decoder block (`LlamaDecoderLayer`,
`OPTDecoderLayer`, `GPTNeoXLayer`, `GPT2Block`, ...). The blocks are the ``ModuleList`` whose
entries are all of those classes, wherever it lives (`model.layers`, `model.decoder.layers`,
`gpt_neox.layers`, `transformer.h`).
"""

from __future__ import annotations

from torch import nn

from harness.distributed import unwrap


class BlocksNotFound(ValueError):
    """The model does not say which modules are its repeated blocks, or no list holds them."""


def _is_block(module: nn.Module, names: set[str]) -> bool:
    # Activation-checkpoint and compile wrappers hold a block one attribute deeper: its class is the
    # wrapped module's. FSDP2 swaps in a subclass (`FSDPLlamaDecoderLayer`): the block class is then a base class.
    return any(cls.__name__ in names for cls in type(unwrap(module)).__mro__)


def block_class_names(model: nn.Module) -> set[str]:
    """The class names transformers marks as unsplittable, for the model and its sub-models."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def decoder_block_list(model: nn.Module) -> nn.ModuleList:
    """The ``ModuleList`` holding the decoder blocks (wrappers replace its entries in place)."""
    names = block_class_names(model)
    if not names:
        raise BlocksNotFound(
            f"{type(model).__name__} does not declare its decoder block class (transformers' "
            "_no_split_modules is empty), so harness cannot shard, checkpoint or prune it block by block"
        )
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(_is_block(m, names) for m in module):
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise BlocksNotFound(f"no module list of {type(model).__name__} holds its decoder blocks ({', '.join(sorted(names))})")
    return best


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF causal LM (the unit of sharding and AC)."""
    return list(decoder_block_list(model))
