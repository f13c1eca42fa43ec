"""What a memory tracker cannot tell from a module alone, said by the engine that stores it.

The trackers see a module's parameters and a torch optimizer's state. Where an engine keeps
parameter storage or fp32 masters elsewhere (DeepSpeed ZeRO's partitions and its optimizer
wrapper's flat copies), or shards the module so that a collective-aware tracker is needed
(FSDP2), the engine describes that here (`harness.engine.Engine.memory_storage`), so this
package never inspects an engine's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def _none() -> Sequence[torch.Tensor]:
    return ()


@dataclass(frozen=True)
class ModelStorage:
    """How the model being tracked is stored; the default is a plain module and a torch optimizer."""

    # FSDP2-sharded root: FSDPMemTracker (all-gather / reduce-scatter buffers are `communication`),
    # and sharded parameters get no autograd gradient of their own.
    sharded: bool = False
    # Parameter storage the module's parameters do not show (ZeRO-3: each rank's partitions), read each step.
    partitions: Callable[[], Sequence[torch.Tensor]] = _none
    # fp32 master copies an optimizer wrapper keeps outside its inner optimizer's state (ZeRO), read each step.
    masters: Callable[[], Sequence[torch.Tensor]] = _none
