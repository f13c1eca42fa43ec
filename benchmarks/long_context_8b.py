"""The planner's longest sequence for Llama-3-8B, from its line: two traced lengths, extrapolated.

    python benchmarks/long_context_8b.py > table.md
    python benchmarks/long_context_8b.py --sequence 8   # the 8-GPU rows with Ulysses over all 8

`harness.plan --max-seq-len` searches with a traced step per probe; at 8B with tiles of 4096
tokens, a probe near the answer (hundreds of thousands of tokens: a hundred MLP tiles in each
of 32 blocks) traces for many minutes on a shared 2-core machine. A step's bytes are a line in
the sequence length for a fixed config (the search relies on it too), so this script traces
each config at two lengths (`--at`, default 16384 and 32768), judges each with the planner's
own verdict, and reports where the line through them crosses each device/host budget: the
first step of the search, which its later probes confirm. Each row is one config on one
machine shape; the GPU allowance (context, NCCL, fragmentation) is in the device bytes.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.config import load_config
from harness.planner import estimate
from harness.planner.report import gib, parse_size, verdict

COMMON = ["model.name=llama3-8b", "precision=bf16", "micro_batch_size=1", "memory.activation_checkpointing=full"]
COMMON += ["memory.loss_chunk_size=1024"]
LONG = ["memory.tiled_mlp_tokens=4096", "memory.offload_checkpoint_inputs=true"]
# (label, world, overrides, [(machine, gpu memory, host memory per node)])
SETUPS = [
    ("8 GPUs, FSDP2", 8, ["strategy=fsdp"], [("8 x 80 GiB", "80GiB", "2TiB")]),
    (
        "1 GPU, ZeRO-3 offload (params + optimizer on the host)",
        1,
        ["strategy=zero3_offload"],
        [("1 x 80 GiB", "80GiB", "1TiB"), ("1 x 24 GiB", "24GiB", "256GiB")],
    ),
]


def line_answer(world: int, overrides: list[str], lengths: tuple[int, int], machines: list[tuple[str, str, str]]) -> list[str]:
    points = []
    for seq in lengths:
        est = estimate(load_config(None, [*overrides, f"data.seq_len={seq}"]), world, target="cuda", vocab_size=128256)
        points.append((seq, est))
    rows = []
    for machine, gpu, cpu in machines:
        gpu_b, cpu_b = parse_size(gpu), parse_size(cpu)
        (s0, e0), (s1, e1) = points
        v0, v1 = verdict(e0, gpu_b, cpu_b, world), verdict(e1, gpu_b, cpu_b, world)
        dev_slope = (v1.device_need - v0.device_need) / (s1 - s0)
        host_slope = ((v1.host_need_per_node or 0) - (v0.host_need_per_node or 0)) / (s1 - s0)
        by_device = s0 + (gpu_b - v0.device_need) / dev_slope if dev_slope > 0 else float("inf")
        by_host = s0 + (cpu_b - (v0.host_need_per_node or 0)) / host_slope if host_slope > 0 else float("inf")
        answer = int(min(by_device, by_host)) // 1024 * 1024
        bound = "device" if by_device <= by_host else "host"
        config = " ".join(o for o in overrides if o not in COMMON)
        first = f"{s0:,}: {gib(v0.device_need)} / host {gib(v0.host_need_per_node or 0)}"
        second = f"{s1:,}: {gib(v1.device_need)} / host {gib(v1.host_need_per_node or 0)}"
        slopes = f"{dev_slope / 1024:,.1f} KiB | {host_slope / 1024:,.1f} KiB"
        rows.append(f"| {machine} | {config} | {first} | {second} | {slopes} | **{answer:,}** ({bound}) |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", type=int, nargs=2, default=[16384, 32768])
    parser.add_argument("--variant", choices=("long", "base"), default="long", help="base: without the tiled MLP and the offload")
    parser.add_argument("--sequence", type=int, default=1, help="N > 1: parallel.sequence=N, the setups whose world N divides")
    args = parser.parse_args()
    print("| machine | config | device / host at the first length | at the second | device/token | host/token (node) | longest seq_len |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for _, world, strategy, machines in SETUPS:
        if world % args.sequence:
            continue
        split = [f"parallel.sequence={args.sequence}"] if args.sequence > 1 else []
        overrides = [*COMMON, *strategy, *(LONG if args.variant == "long" else []), *split]
        for row in line_answer(world, overrides, tuple(args.at), machines):
            print(row, flush=True)


if __name__ == "__main__":
    main()
