"""FSDP2's CPU offload (`CPUOffloadPolicy`, `fsdp_offload.json`) as one rank holds it.

Every shard FSDP2 manages lives on the host: the parameters (fp32 masters of what trains, the
frozen ones in their own dtype), the sharded gradients and the optimizer's state and step. The
device holds what the traced step already shows - each group's all-gather output (the trace's
communication bytes) and the unsharded parameters FSDP2 copies it into while the group runs (the
trace's parameters beyond its held shards), the unsharded gradients a group's backward makes
until they are reduce-scattered (the trace's gradients less its reduced shards), activations,
temporaries - plus the host-to-device
copies of the shards a group all-gathers, which exist until they are copied into the all-gather
buffer: two groups' worth, FSDP2 prefetching the next group's gather while one computes. The
reduce-scattered gradient of a group is copied back to the host the same way (its device copy
is one group's gradient shard, counted in the same allowance). Whatever FSDP2 does not manage
stays on the device: a QLoRA base's quantization state (`harness.planner.lora`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder block's parameters: one FSDP2 group per block

GATHERS_IN_FLIGHT = 2  # the group computing and the one prefetched


def largest_group_shard(shards: Iterable[tuple[str, int]]) -> int:
    """The largest FSDP2 group's shard on one rank, from (parameter name, its shard's bytes):
    a decoder block's parameters form one group; any other parameter is counted as its own (the
    embeddings and the head are groups of one; the root's leftovers are small)."""
    groups: dict[str, int] = defaultdict(int)
    for name, nbytes in shards:
        match = BLOCK.search(name)
        groups[f"block {match.group(1)}" if match else name] += nbytes
    return max(groups.values(), default=0)


def in_flight_bytes(group_shard: int) -> int:
    """Device bytes of the shards being copied to the device for their all-gathers."""
    return GATHERS_IN_FLIGHT * group_shard


__all__ = ["BLOCK", "GATHERS_IN_FLIGHT", "in_flight_bytes", "largest_group_shard"]
