"""The module inside the wrappers distribution and compilation put around it: the one unwrap.

DDP and DeepSpeed's engine hold the user's module as ``.module``; ``torch.compile``'s
``OptimizedModule`` as ``._orig_mod``; activation checkpointing's and FSDP1's wrappers one
attribute deeper (and in their parameters' names). The loss installs its chunked forward on
the module inside all of them, the memory tracker and pruning walk its blocks, and a block's
class is the wrapped module's: each asks here instead of knowing the wrappers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

# Wrappers that put a module one attribute deeper (activation checkpoint, compile, FSDP1).
WRAPPER_ATTRS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def is_deepspeed_engine(obj: Any) -> bool:
    """Whether ``obj`` is a DeepSpeed engine, without importing DeepSpeed (a run that never
    imported it has none)."""
    engine_class = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)
    return engine_class is not None and isinstance(obj, engine_class)


def wrapper_chain(module: Any) -> Iterator[nn.Module]:
    """``module``, then each module it wraps, outermost first, down to the user's own."""
    while True:
        yield module
        inner = next((getattr(module, a, None) for a in WRAPPER_ATTRS if isinstance(getattr(module, a, None), nn.Module)), None)
        if inner is None and (isinstance(module, nn.parallel.DistributedDataParallel) or is_deepspeed_engine(module)):
            inner = module.module
        if inner is None:
            return
        module = inner


def unwrap(module: Any) -> nn.Module:
    """The user's module inside every wrapper (DDP, DeepSpeed engine, compile, AC, FSDP1);
    FSDP2 shards in place, so an FSDP2 module is its own."""
    *_, inner = wrapper_chain(module)
    return inner


__all__ = ["WRAPPER_ATTRS", "is_deepspeed_engine", "unwrap", "wrapper_chain"]
