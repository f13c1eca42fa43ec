"""Predicted vs measured step peak for every optimizer rung (optim.name x precision x engine).

    R=benchmarks/results/optimizers
    TORCHDYNAMO_DISABLE=1 nice -n 19 python benchmarks/optimizer_accuracy.py --out $R/optimizer_accuracy.json
    TORCHDYNAMO_DISABLE=1 nice -n 19 python benchmarks/optimizer_accuracy.py --worlds 2 --out $R/optimizer_accuracy.json  # world 2 again
    python benchmarks/optimizer_accuracy.py --from-json $R/optimizer_accuracy.json   # the table again, planner re-run

Each config is a real run measured the way ``benchmarks/plan_accuracy.py`` measures
(``harness.planner.measure``: MemTracker over every storage the process allocates, 3 steps, the
worst rank's largest step), beside ``harness.planner.estimate`` of the same config for a CPU
target. The measured peaks are kept in a JSON file so the planner's column can be recomputed
after a planner change without measuring again (the measurement does not depend on the planner).
torchao's step runs eager (``TORCHDYNAMO_DISABLE=1``), as in the tests; a compiled step on a GPU
may fuse temporaries away. bitsandbytes on CPU is its plain 8-bit step (no paging).

MemTracker follows the storages of the ops it sees through torch's dispatch; a custom op's kernel
(bitsandbytes' ``optimizer_update_8bit_blockwise``, registered for CPU in Python) and a tensor
subclass's dispatch (torchao's quantized states) run below it, so the fp32 copies they make are
invisible to it. Every case is therefore measured a second way in the same run: the CPU allocator's
own running account (``harness.memory.AllocatorTrace``: ``torch.profiler`` memory events, every
allocation and free, inside custom ops too), entered before the model is built, its largest value
during the steps ("profiler peak").
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from harness.config import load_config
from harness.planner import estimate
from harness.planner.measure import launch

OIB = ["memory.optimizer_in_backward=true", "optim.grad_clip=0"]
# (world, strategy, optimizer, precision, extra overrides): every combination the trainer accepts
CASES: list[tuple[int, str, str, str, list[str]]] = [
    *[(1, "ddp", name, "fp32", []) for name in ("adamw", "adamw_bf16", "adamw_8bit", "adamw_4bit", "paged_adamw_8bit")],
    (1, "ddp", "adamw", "bf16", []),
    (1, "ddp", "paged_adamw_8bit", "bf16", []),
    *[(1, "ddp", name, "bf16_pure", []) for name in ("adamw_bf16", "adamw_8bit", "adamw_4bit")],
    (1, "ddp", "adamw_8bit", "bf16_pure", OIB),
    (1, "ddp", "paged_adamw_8bit", "bf16", OIB),
    *[(2, "fsdp", name, "fp32", []) for name in ("adamw", "adamw_bf16", "adamw_8bit", "adamw_4bit")],
    (2, "fsdp", "adamw_bf16", "bf16_pure", []),
    (2, "fsdp", "adamw_8bit", "fp32", OIB),
]


def overrides_of(case: tuple[int, str, str, str, list[str]], shape: list[str]) -> list[str]:
    _, strategy, name, precision, extra = case
    return [f"strategy={strategy}", *shape, f"optim.name={name}", f"precision={precision}", *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", help="write the measured peaks here (JSON)")
    parser.add_argument("--from-json", help="measured peaks from an earlier run: only the planner runs")
    parser.add_argument("--worlds", type=int, nargs="+", help="measure only these world sizes; --out keeps the other rows")
    args = parser.parse_args()
    shape = [f"model.name={args.model}", f"micro_batch_size={args.micro_batch}", f"data.seq_len={args.seq_len}"]
    runs = [overrides_of(c, shape) for c in CASES]
    if args.from_json:
        with open(args.from_json) as f:
            measured = json.load(f)
    else:
        worlds = args.worlds or sorted({c[0] for c in CASES})
        kept = []
        if args.out and args.worlds and os.path.exists(args.out):
            with open(args.out) as f:
                kept = [row for row in json.load(f) if row["world"] not in worlds]
        measured = []
        for world in worlds:
            mine = [(c, r) for c, r in zip(CASES, runs) if c[0] == world]
            results = launch(
                [r for _, r in mine], world, steps=3, vocab_size=args.vocab_size, trainer_view=False, allocator=True, timeout=1800
            )
            for (case, overrides), ranks in zip(mine, results):
                row = {"world": world, "overrides": overrides, "peak": max(r["peak"] for r in ranks)}
                row["profiled"] = max(r["allocator_peak"] for r in ranks)
                measured.append(row)
            print(f"... world {world} measured", file=sys.stderr, flush=True)
        measured = sorted(kept + measured, key=lambda row: row["world"])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(measured, f, indent=1)
    print(
        "| world | strategy | optim.name | precision | opt. in backward | MemTracker peak | profiler peak | planned | "
        "error vs MemTracker | error vs profiler | planned peak moment |"
    )
    print("|---:|---|---|---|---|---:|---:|---:|---:|---:|---|")
    for row in measured:
        cfg = load_config(None, row["overrides"])
        est = estimate(cfg, row["world"], target="cpu", vocab_size=args.vocab_size)
        ours, race = est.total, est.race_bytes

        def err(m: int | None) -> str:  # a run peaks in [total - race, total]
            return "-" if m is None else f"{(min(max(m, ours - race), ours) - m) / m:+.1%}"

        prof = row.get("profiled")
        print(
            f"| {row['world']} | {cfg.strategy} | {cfg.optim.name} | {cfg.precision} | "
            f"{'yes' if cfg.memory.optimizer_in_backward else 'no'} | {row['peak']:,} | {'-' if prof is None else f'{prof:,}'} | "
            f"{ours:,} | {err(row['peak'])} | {err(prof)} | {est.peak.name} |"
        )


if __name__ == "__main__":
    main()
