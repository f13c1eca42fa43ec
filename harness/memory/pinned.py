"""Pinned (page-locked) host memory as torch's caching host allocator takes it.

Every pinned allocation torch makes - `torch.empty(..., pin_memory=True)`, `Tensor.pin_memory()`,
a device tensor's `.to("cpu", non_blocking=True)` - goes through the caching host allocator
(`ATen/core/CachingHostAllocator.h`, `CachingHostAllocatorImpl::allocate`), which rounds the
request up to the next power of two ("to improve reuse"; the rounded sizes index its free lists)
and page-locks that many bytes: 5.5 GiB asked for holds 8 GiB. A freed block stays cached (still
pinned) for the next request of its size class. torch 2.13 rounds every size by default
(`pinned_max_round_threshold_mb` in `PYTORCH_ALLOC_CONF` is unset: no threshold).

What pins in a harness run, each one allocation per buffer: activation offload's host copies
(`harness.memory.activation_offload`, one per saved tensor); FSDP2's `CPUOffloadPolicy` on a GPU
(each parameter's padded shard, and each reduce-scattered gradient shard copied to the host); a
DeepSpeed strategy whose `offload_optimizer`/`offload_param` block says `"pin_memory": true` (its
flat partitions and staging buffers). The planner books each of them with `pinned_block`.
"""

from __future__ import annotations

from collections.abc import Iterable


def pinned_block(nbytes: int) -> int:
    """The bytes a pinned allocation of `nbytes` holds: the next power of two (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def pinned_bytes(sizes: Iterable[int]) -> int:
    """The pinned bytes of one allocation per size."""
    return sum(pinned_block(n) for n in sizes)


__all__ = ["pinned_block", "pinned_bytes"]
