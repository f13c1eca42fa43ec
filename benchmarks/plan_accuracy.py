"""Predicted vs measured per-rank peak, side by side with DeepSpeed's and accelerate's estimators.

    python benchmarks/plan_accuracy.py > table.md
    python benchmarks/plan_accuracy.py --strategies ddp fsdp fsdp_grad_op --extra lora.enabled=true > lora.md
    python benchmarks/plan_accuracy.py --model runs/loading/llama-300m --worlds 2 --strategies ddp fsdp zero2 zero3 \
        --precisions fp32 --ac none --seq-len 64 --micro-batch 1 > table_300m.md   # at ~300M parameters

For every CPU-runnable strategy x {fp32, bf16} x {AC none, full} x world {1, 2} on the tiny
Llama (micro-batch 2, seq 64): the real run measured with MemTracker over every storage
(``harness.planner.measure``), the same run as the trainer's own ``StepMemoryTracker``
sees it, our prediction, DeepSpeed's ``estimate_zero2/3_model_states_mem_needs`` and the
formula of ``accelerate estimate-memory`` (its CLI needs a Hub model: with a local
directory it stops with ``HFValidationError: Repo id must be in the form 'repo_name'``, so
its ``estimate_training_usage`` is applied to our meta model, exactly what the CLI does
after loading). Errors are against the measured peak.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.config import load_config
from harness.planner import estimate
from harness.planner.measure import launch

STRATEGIES = ["ddp", "fsdp", "fsdp_grad_op", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
VOCAB = 2048


def deepspeed_estimate(strategy: str, total: int, largest: int, world: int) -> int | None:
    """DeepSpeed's own per-rank model-state estimate (GPU + this rank's share of the node's CPU), or None."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if strategy in ("zero2", "zero2_offload"):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, world, 1, cpu_offload=strategy == "zero2_offload")
    elif strategy in ("zero3", "zero3_offload"):
        off = strategy == "zero3_offload"
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total, largest, world, 1, cpu_offload=off, cpu_offload_params=off, zero_init=True
        )
    else:
        return None
    # The CPU figure is for the node; with offload it is real per-rank memory on a CPU run.
    return int(gpu + (cpu / world if "offload" in strategy else 0))


def accelerate_estimate(total_bytes_fp32: int, precision: str) -> int:
    from accelerate.commands.estimate import estimate_training_usage

    usage = estimate_training_usage(total_bytes_fp32, "float32" if precision == "fp32" else "bfloat16")
    return max(usage.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="a preset or a saved model directory")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--ac", nargs="+", default=["none", "full"])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--vocab-size", type=int, default=None, help="vocabulary of a preset (default: tiny-llama's 2048)")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run, e.g. lora.enabled=true")
    args = parser.parse_args()
    shape = [f"model.name={args.model}", f"micro_batch_size={args.micro_batch}", f"data.seq_len={args.seq_len}", *args.extra]
    vocab = args.vocab_size or (VOCAB if args.model == "tiny-llama" else None)
    rows = []
    for world in args.worlds:
        for strategy in args.strategies:
            runs = [
                [f"strategy={strategy}", *shape, f"precision={p}", f"memory.activation_checkpointing={ac}"]
                for p in args.precisions
                for ac in args.ac
            ]
            results = launch(runs, world, steps=3, vocab_size=vocab, trainer_view=True, timeout=args.timeout)
            for overrides, ranks in zip(runs, results):
                measured = max(r["peak"] for r in ranks)
                trainer = [r["trainer_tracker_peak"] for r in ranks]
                est = estimate(load_config(None, overrides), world, target="cpu", vocab_size=vocab)
                total = est.params_total
                ds = deepspeed_estimate(strategy, total, est.largest_param, world)
                acc = accelerate_estimate(total * 4, overrides[-2].split("=")[1])
                rows.append(
                    (
                        strategy,
                        world,
                        overrides[-2].split("=")[1],
                        overrides[-1].split("=")[1],
                        measured,
                        max(t for t in trainer if t is not None) if any(t is not None for t in trainer) else None,
                        est.total,
                        est.race_bytes,
                        est.peak.name,
                        ds,
                        acc,
                    )
                )
            print(f"... {strategy} world {world} done", file=sys.stderr, flush=True)
    print(
        "| strategy | world | precision | AC | measured peak | trainer tracker | ours | ours err | "
        "DeepSpeed est. | DS err | accelerate est. | acc. err | our peak moment |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for s, w, p, ac, m, t, ours, race, moment, ds, acc in rows:

        def err(x: int | None, race: int = 0) -> str:
            # ours: the distance from [total - race_bytes, total] (harness.planner.estimate.collective_race_bytes)
            return "n/a" if x is None else f"{(min(max(m, x - race), x) - m) / m:+.1%}"

        print(
            f"| {s} | {w} | {p} | {ac} | {m:,} | {t if t is None else f'{t:,}'} | {ours:,} | {err(ours, race)} | "
            f"{'n/a' if ds is None else f'{ds:,}'} | {err(ds)} | {acc:,} | {err(acc)} | {moment} |"
        )


if __name__ == "__main__":
    main()
