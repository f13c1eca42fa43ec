"""How often gloo still holds a broadcast tensor after `dist.broadcast` has returned.

DeepSpeed's `zero.Init` broadcasts each new parameter as a uint8 view before partitioning it.
gloo's worker thread keeps its own reference to the tensor it broadcast until that thread next
runs, which may be after the caller has moved on: the view (and so the whole parameter's storage)
is then still alive while the next parameter is built (the ZeRO-3 load-phase bound in
`harness.planner.estimate.load_phase_bytes` and tests/integration/test_model_loading.py counts one
such tensor; `collective_race_bytes` is the same race in the step). This counts, over `--count`
broadcasts between two ranks, how often the storage's use count shows a reference beyond the
caller's right after `broadcast` returns. It needs a loaded machine to show (notes/performance.md).

With ``--allocator`` the loop also runs under torch.profiler's memory events, the account
`harness.memory.AllocatorTrace` keeps: the profiler records the allocations and frees of the
threads it follows, not those of gloo's worker thread, so a tensor whose last reference the worker
drops is freed unseen and stays in the running sum. Every tensor of the loop is gone at its end,
so the sum left is what the allocator's account over-counts (notes/ladder.md: the ZeRO-3 rows).

    torchrun --nproc_per_node=2 benchmarks/gloo_view_hold.py --count 2000 [--allocator]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--numel", type=int, default=32768)
    parser.add_argument("--allocator", action="store_true", help="also count what the allocator's account never sees freed")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, held = dist.get_rank(), 0
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if args.allocator else contextlib.nullcontext()
    with prof:
        for _ in range(args.count):
            t = torch.ones(args.numel) if rank == 0 else torch.empty(args.numel)
            storage = t.untyped_storage()  # the caller's references: `t` and this wrapper
            dist.broadcast(t.view(torch.uint8), 0)
            if torch._C._storage_Use_Count(storage._cdata) > 2:  # the broadcast view is still referenced
                held += 1
            del t, storage
        dist.barrier()  # gloo's worker has run since: every tensor of the loop is freed
    print(f"rank {rank}: the broadcast tensor was still held after broadcast returned {held} of {args.count} times", flush=True)
    if args.allocator:
        left = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
        print(f"rank {rank}: allocator account left {left:,} B = {left / (4 * args.numel):.0f} tensors never seen freed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
