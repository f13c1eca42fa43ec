"""Long-sequence knobs on CPU: the planner's prediction against a measured step, and the offloaded bytes.

    python benchmarks/long_context.py > table.md
    python benchmarks/long_context.py --seq-lens 8192 16384 --model small-llama

For each sequence length x knob (activation checkpointing + chunked loss as the base; the tiled
MLP; checkpoint-input offload; both), one rank, fp32: the real step measured with MemTracker
over every storage (``harness.planner.measure``: the trainer's engine and loss), beside the
planner's estimate of the same config for a CPU run (``target=cpu``: one memory, so the offload
moves nothing and its bytes stay in the peak) and its activation category. Then, for the
offload, one real forward + backward under the trainer's ``ActivationOffload`` (checkpoint
inputs, the copy path run on the host): the bytes it moved and the most it held fetched ahead,
beside the planner's host bytes for a GPU run (``target=cuda``, the offload simulated in the
trace). A CPU cannot show the device saving itself; notes/long_context.md says what was shown.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from harness.config import load_config
from harness.engine import apply_memory_techniques
from harness.memory import ActivationOffload
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
    apply_memory_techniques(model, cfg)
    ids = torch.randint(0, vocab, (cfg.micro_batch_size, cfg.data.seq_len), generator=torch.Generator().manual_seed(0))
    offload = ActivationOffload(copy_on_host=True, scope="checkpoint_inputs", model=model)
    with offload:
        loss = causal_lm_loss(model, ids, chunk_size=cfg.memory.loss_chunk_size)
    loss.backward()
    return offload.stats.offloaded_bytes, offload.stats.peak_fetched_bytes, offload.stats.offloaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args()
    base = [
        f"model.name={args.model}",
        "micro_batch_size=1",
        "precision=fp32",
        "strategy=ddp",
        "memory.activation_checkpointing=full",
        "memory.loss_chunk_size=1024",
    ]
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
