"""The long-sequence knobs' step time, measured: each knob's trainer step against the same run
without it, interleaved in one invocation (the host is shared and noisy), beside the planner's
stated factor (`harness.planner.candidates.SPEED["memory"]`).

    python benchmarks/knob_step_time.py [--model real] [--seq-len 1152] [--steps 3] [--repeats 2]

Rows, each through the user's entry points (`python -m harness.train`, `torchrun harness/train.py`),
fp32, micro-batch 1, activation checkpointing + chunked loss as the base:
- one process: the base; + the tiled MLP (`memory.tiled_mlp_tokens`, 4 tiles of the sequence);
  + checkpoint-input offload (on a CPU the copy path runs, host to host: what it costs here is the
  bookkeeping and the copies, not a PCIe transfer, and nothing overlaps it);
- N ranks (DDP), N sequences per step: whole sequences (one per rank) against each sequence split
  over the N ranks (`parallel.sequence=N grad_accum=N`: the same tokens per step and rank, plus the
  attention exchange over gloo, not NVLink). N is the smallest degree the model's heads take
  (SmolLM2's 9 heads and 3 key/value heads: 3, so on a 2-core host both rows share 2 cores among 3).
Every process runs one thread (`sequence_parallel.run`).
The step time of each run is the median of its steps after the first (`perf/step_time_s`);
each row's ratio is taken against its own base's median over the same repeats.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model
from sequence_parallel import BIN, run, steps_of, write_config

from harness.models import model_spec
from harness.planner.candidates import SPEED

BASE = ["memory.activation_checkpointing=full", "memory.loss_chunk_size=1024"]


def rows_for(seq_len: int, ranks: int) -> list[tuple[str, int, list[str], str, float]]:
    """(row, ranks, overrides, the base it is compared with, the planner's stated factor)."""
    tiles = f"memory.tiled_mlp_tokens={seq_len // 4}"
    offload = "memory.offload_checkpoint_inputs=true"
    split = ["strategy=ddp", f"parallel.sequence={ranks}", f"grad_accum={ranks}"]
    one, whole, memory = "base: AC + chunked loss", f"{ranks} ranks, whole sequences", SPEED["memory"]
    return [
        (one, 1, BASE, "", 1.0),
        ("+ tiled MLP (4 tiles)", 1, [*BASE, tiles], one, memory["tiled_mlp"]),
        ("+ checkpoint-input offload", 1, [*BASE, offload], one, memory["offload_checkpoint_inputs"]),
        (whole, ranks, [*BASE, "strategy=ddp"], "", 1.0),
        (f"{ranks} ranks, split (parallel.sequence={ranks})", ranks, [*BASE, *split], whole, memory["sequence_parallel"]),
    ]


def smallest_degree(model: str) -> int:
    """The smallest N > 1 that divides the model's attention heads and key/value heads."""
    config = model_spec(model).config
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    return next(n for n in range(2, heads + 1) if heads % n == 0 and kv % n == 0)


def timed_run(work: Path, name: str, model: str, seq_len: int, steps: int, ranks: int, overrides: list[str]) -> list[float]:
    """One run's step times after the first (the first builds and warms)."""
    config = write_config(work / f"{name}.yaml", model, seq_len, steps, work / "cache", work / name)
    if ranks == 1:
        run([sys.executable, "-m", "harness.train", "--config", str(config), *overrides])
    else:
        run(
            [
                str(BIN / "torchrun"),
                f"--nproc_per_node={ranks}",
                "--master_port=29653",
                "harness/train.py",
                "--config",
                str(config),
                *overrides,
            ]
        )
    return [s["perf/step_time_s"] for s in steps_of(work / name)[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="real", help="'real' (SmolLM2-135M), a preset or a model directory")
    parser.add_argument("--seq-len", type=int, default=1152)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every row, interleaved")
    args = parser.parse_args()
    model = str(real_model.prepare()) if args.model == "real" else args.model
    degree = smallest_degree(model)
    if args.seq_len % (4 * degree):
        parser.error(f"--seq-len must be a multiple of {4 * degree}: 4 MLP tiles, and {degree} equal slices for the split")
    rows = rows_for(args.seq_len, degree)
    times: dict[str, list[float]] = {row[0]: [] for row in rows}
    with tempfile.TemporaryDirectory(prefix="knob-time-") as tmp:
        work = Path(tmp)
        prepared = write_config(work / "data.yaml", model, args.seq_len, args.steps, work / "cache", work / "data")
        run([sys.executable, "-m", "harness.data", "--config", str(prepared)])  # once, outside every timing
        for repeat in range(args.repeats):
            for i, (name, ranks, overrides, _, _) in enumerate(rows):
                times[name] += timed_run(work, f"r{repeat}_{i}", model, args.seq_len, args.steps, ranks, overrides)
                print(f"  round {repeat + 1}: {name}: {times[name][-(args.steps - 1) :]}", file=sys.stderr, flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"model {model}, seq {args.seq_len}, fp32, micro-batch 1, {args.repeats} rounds x {args.steps - 1} timed steps\n")
    print("| row | ranks | median step s | against | measured factor | planner's stated factor |")
    print("|---|---:|---:|---|---:|---:|")
    out = []
    for name, ranks, _, base, stated in rows:
        factor = median[name] / median[base] if base else 1.0
        print(f"| {name} | {ranks} | {median[name]:.2f} | {base or '-'} | {factor:.3f} | {stated:.2f} |")
        out.append({"row": name, "ranks": ranks, "step_s": times[name], "median_s": median[name], "factor": factor, "stated": stated})
    print(json.dumps({"model": model, "seq_len": args.seq_len, "rows": out}))


if __name__ == "__main__":
    main()
