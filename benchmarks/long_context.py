"""Long-sequence knobs on CPU: the planner's prediction against a measured step, and the offloaded bytes.

    python benchmarks/long_context.py > table.md
    python benchmarks/long_context.py --seq-lens 8192 16384 --model small-llama --vocab-size 4096
    python benchmarks/long_context.py --sequence 2   # Ulysses: per-rank planned vs measured at world 2
    python benchmarks/long_context.py --packed --seq-lens 4096 8192   # packed instruction rows, N=1 and 2

First the MLP alone (hidden 64, intermediate 1024, seq 8192): its activation peak by harness's
own per-category tracker (``StepMemoryTracker``) untiled and at 2 to 16 tiles. Then, for
each sequence length x knob (activation checkpointing + chunked loss as the base; the tiled
MLP; checkpoint-input offload; both), one rank, fp32: the real step measured with MemTracker
over every storage (``harness.planner.measure``: the trainer's engine and loss), beside the
planner's estimate of the same config for a CPU run (``target=cpu``: one memory, so the offload
moves nothing and its bytes stay in the peak) and its activation category. Then, for the
offload, one real forward + backward under the trainer's ``ActivationOffload`` (checkpoint
inputs, the copy path run on the host): the bytes it moved and the most it held fetched ahead,
beside the planner's host bytes for a GPU run (``target=cuda``, the offload simulated in the
trace). A CPU cannot show the device saving itself; notes/long_context.md says what was shown.

``--sequence N``: instead, `parallel.sequence=N` at world N (data-parallel size 1) under DDP and
FSDP2, with and without the tiled MLP: the largest per-rank peak of real steps (every rank fed its
slice, `harness.planner.measure`) against the planner's estimate, beside one process's measured
peak of the same whole sequence (the baseline, measured in the same run).

``--packed``: instead, packed instruction rows (four examples a row, positions restarting:
`harness.planner.measure.packed_rows`), whose attention mask is (B, 1, S, S): one process under
DDP, and Ulysses at world 2 under DDP and FSDP2, measured against the planner, beside what the
planner gives the same config with unpacked rows (what it traced for packed ones before it
modelled the mask).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from harness.config import load_config
from harness.memory import ActivationOffload, StepMemoryTracker, apply_tiled_mlp, prepare_model
from harness.models import build_model
from harness.planner import estimate
from harness.planner.measure import launch
from harness.training import causal_lm_loss

KNOBS = {
    "AC + chunked loss": [],
    "+ tiled MLP (8 tiles)": ["memory.tiled_mlp=8"],
    "+ checkpoint-input offload": ["memory.offload_checkpoint_inputs=true"],
    "+ both": ["memory.tiled_mlp=8", "memory.offload_checkpoint_inputs=true"],
}


def offloaded_for_real(overrides: list[str], vocab: int) -> tuple[int, int, int]:
    """(bytes moved to the host, most held fetched ahead, blocks) of one real step under the trainer's offload."""
    cfg = load_config(None, overrides)
    model = build_model(cfg.model.name, seed=0, vocab_size=vocab)
    prepare_model(model, cfg.memory)
    ids = torch.randint(0, vocab, (cfg.micro_batch_size, cfg.data.seq_len), generator=torch.Generator().manual_seed(0))
    offload = ActivationOffload(copy_on_host=True, scope="checkpoint_inputs", model=model)
    with offload:
        loss = causal_lm_loss(model, ids, chunk_size=cfg.memory.loss_chunk_size)
    loss.backward()
    return offload.stats.offloaded_bytes, offload.stats.peak_fetched_bytes, offload.stats.offloaded


def mlp_activation_peak(tiles: int, seq: int, intermediate: int) -> int:
    """Activation peak of one decoder MLP's forward + backward by harness's own tracker (hidden 64, fp32)."""
    model = build_model("tiny-llama", seed=0, config_overrides={"num_hidden_layers": 1, "intermediate_size": intermediate})
    if tiles:
        apply_tiled_mlp(model, tiles)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, seq, 64, requires_grad=True)
    tracker = StepMemoryTracker(mlp, None)
    with tracker.step():
        mlp(x).sum().backward()
    return tracker.last_category_maxima()["activations"]


def mlp_table(seq: int = 8192, intermediate: int = 1024) -> None:
    io = 2 * seq * 64 * 4  # the MLP's output and its input's gradient: whole-sequence at any tiling
    untiled = mlp_activation_peak(0, seq, intermediate)
    print(f"| MLP tiles (seq {seq}, hidden 64, intermediate {intermediate}) | activation peak | minus in/out | vs untiled |")
    print("|---:|---:|---:|---:|")
    for tiles in (0, 2, 4, 8, 16):
        peak = mlp_activation_peak(tiles, seq, intermediate) if tiles else untiled
        print(f"| {tiles or 'untiled'} | {peak:,} | {peak - io:,} | {(untiled - io) / (peak - io):.2f}x smaller |")
    print()


def sequence_table(args: argparse.Namespace, base: list[str]) -> None:
    n = args.sequence
    knobs = {"AC + chunked loss": [], "+ tiled MLP (8 tiles)": ["memory.tiled_mlp=8"]}
    runs = [
        [*base, f"strategy={s}", f"data.seq_len={seq}", *extra]
        for seq in args.seq_lens
        for s in ("ddp", "fsdp")
        for extra in knobs.values()
    ]
    split = [[*r, f"parallel.sequence={n}"] for r in runs]
    whole = launch(runs, 1, steps=2, vocab_size=args.vocab_size, trainer_view=False, timeout=args.timeout)
    parts = launch(split, n, steps=2, vocab_size=args.vocab_size, trainer_view=False, timeout=args.timeout)
    print(f"| seq_len | engine | knobs | one process (N=1) | measured per rank (N={n}) | planned (N={n}) | error | N={n} / N=1 | ", end="")
    print(f"measured activations (N={n}) | planned activations |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    names = list(knobs) * 2 * len(args.seq_lens)
    for name, overrides, one, ranks in zip(names, split, whole, parts):
        worst = max(ranks, key=lambda r: r["peak"])
        measured, alone = worst["peak"], one[0]["peak"]
        est = estimate(load_config(None, overrides), n, target="cpu", vocab_size=args.vocab_size)
        given = dict(o.split("=", 1) for o in overrides)
        seq, engine = given["data.seq_len"], given["strategy"]
        print(
            f"| {seq} | {engine} | {name} | {alone:,} | {measured:,} | {est.total:,} | {(est.total - measured) / measured:+.2%} | "
            f"{measured / alone:.3f} | {worst['peak_by_category'].get('activations', 0):,} | {est.peak.categories['activations']:,} |"
        )


def packed_table(args: argparse.Namespace, base: list[str]) -> None:
    packed = ["data.format=instruction", "data.source=x.jsonl", "data.packing=true"]
    layouts = [(1, "ddp", []), (2, "ddp", ["parallel.sequence=2"]), (2, "fsdp", ["parallel.sequence=2"])]
    runs: dict[int, list[list[str]]] = {1: [], 2: []}
    for seq in args.seq_lens:
        for world, engine, extra in layouts:
            runs[world].append([*base, f"strategy={engine}", f"data.seq_len={seq}", *packed, *extra])
    results = {w: launch(runs[w], w, steps=2, vocab_size=args.vocab_size, trainer_view=False, timeout=args.timeout) for w in (1, 2)}
    print("| seq_len | world | engine | measured per rank | planned | error | planned as unpacked rows | its error |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for world in (1, 2):
        for overrides, ranks in zip(runs[world], results[world]):
            measured = max(r["peak"] for r in ranks)
            est = estimate(load_config(None, overrides), world, target="cpu", vocab_size=args.vocab_size)
            text = [o for o in overrides if o != "data.packing=true"] + ["data.packing=false"]
            before = estimate(load_config(None, text), world, target="cpu", vocab_size=args.vocab_size).total
            given = dict(o.split("=", 1) for o in overrides)
            print(
                f"| {given['data.seq_len']} | {world} | {given['strategy']} | {measured:,} | {est.total:,} | "
                f"{(est.total - measured) / measured:+.2%} | {before:,} | {(before - measured) / measured:+.2%} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--mlp-only", action="store_true", help="only the MLP table (one process, seconds)")
    parser.add_argument("--sequence", type=int, default=1, help="N > 1: only the sequence-parallel table, at world N")
    parser.add_argument("--packed", action="store_true", help="only the packed-instruction table (world 1 and 2)")
    args = parser.parse_args()
    common = [f"model.name={args.model}", "micro_batch_size=1", "precision=fp32", "memory.activation_checkpointing=full"]
    if args.packed:
        return packed_table(args, [*common, "memory.loss_chunk_size=1024"])
    if args.sequence > 1:
        return sequence_table(args, [*common, "memory.loss_chunk_size=1024"])
    mlp_table()
    if args.mlp_only:
        return
    base = [*common[:3], "strategy=ddp", common[3], "memory.loss_chunk_size=1024"]
    runs = [[*base, f"data.seq_len={seq}", *extra] for seq in args.seq_lens for extra in KNOBS.values()]
    results = launch(runs, 1, steps=2, vocab_size=args.vocab_size, trainer_view=False, timeout=args.timeout)
    print("| seq_len | knobs | measured peak | planned peak | error | measured activations | planned activations |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    names = list(KNOBS) * len(args.seq_lens)
    for name, overrides, ranks in zip(names, runs, results):
        measured = ranks[0]["peak"]
        acts = ranks[0]["peak_by_category"].get("activations", 0)
        est = estimate(load_config(None, overrides), 1, target="cpu", vocab_size=args.vocab_size)
        seq = overrides[len(base)].split("=")[1]
        print(
            f"| {seq} | {name} | {measured:,} | {est.total:,} | {(est.total - measured) / measured:+.2%} | "
            f"{acts:,} | {est.peak.categories['activations']:,} |"
        )
    print()
    print("| seq_len | checkpoint inputs moved (real step) | planned host bytes (GPU run) | blocks | most fetched ahead |")
    print("|---:|---:|---:|---:|---:|")
    for seq in args.seq_lens:
        overrides = [*base, f"data.seq_len={seq}", "memory.offload_checkpoint_inputs=true"]
        moved, fetched, blocks = offloaded_for_real(overrides, args.vocab_size)
        planned = estimate(load_config(None, overrides), 1, target="cuda", vocab_size=args.vocab_size).host.get("checkpoint_inputs", 0)
        print(f"| {seq} | {moved:,} | {planned:,} | {blocks} | {fetched:,} |")


if __name__ == "__main__":
    main()
