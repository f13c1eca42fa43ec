"""Plan vs three measures of a real step, on a 262,144-token model with tied embeddings (FSDP2 x2).

    python benchmarks/plan_tied_vocab.py [--family llama|gemma3] [--hidden 64] > table.md

A random-weight model from a config with Gemma 3's vocabulary and tied embeddings (small width,
two layers, so it runs on 2 cores), FSDP2 at world 2 on CPU, seq 128, micro-batch 1, bf16 and
fp32, chunked loss off and on. Per config and per step (the largest rank):
- MemTracker over every storage from before the model is built (`harness.planner.measure`);
- the CPU allocator's own running account (`AllocatorTrace`, below the dispatcher);
- the trainer's own `StepMemoryTracker` (one more step);
- the kernel's view, independent of torch's accounting: each step run untracked after clearing
  the RSS high-water mark (`/proc/self/clear_refs` 5), `VmHWM` minus `VmRSS` at the step's start
  (glibc's free lists make it noisy by some MB), against MemTracker's peak minus its level between
  steps (parameters + optimizer state).
Then the plan-only rows of the Gemma-3-270M shape (no weights needed): the issue's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from harness.config import load_config
from harness.distributed import free_port
from harness.planner import estimate
from harness.planner.measure import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # PYTHONPATH of the ranks
VOCAB = 262_144
GEMMA3_270M = dict(
    hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256
)


def tied_config(family: str, **shape):
    from transformers import Gemma3TextConfig, LlamaConfig

    common = dict(vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=True)
    if family == "gemma3":
        return Gemma3TextConfig(**{**common, "sliding_window": 64, **shape})
    return LlamaConfig(**common, **shape)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def worker(overrides: list[str], steps: int) -> None:
    """One rank: build the trainer's engine, run untracked steps, print the kernel's peak over each step's start."""
    import torch.distributed as dist

    from harness.config import load_strategy
    from harness.distributed import init_distributed, teardown
    from harness.engine import build_engine, hidden_size_of, plan_engine
    from harness.models import model_spec
    from harness.planner.measure import run_step
    from harness.training import causal_lm_loss

    cfg = load_config(None, overrides)
    info = init_distributed("cpu", force_group=True)
    spec = model_spec(cfg.model.name)
    plan = plan_engine(cfg, load_strategy(cfg.strategy), info.world_size, info.device, hidden_size_of(spec.config))
    engine = build_engine(spec, cfg, plan, info, lambda m, ids: causal_lm_loss(m, ids, chunk_size=cfg.memory.loss_chunk_size))
    gen = torch.Generator().manual_seed(1000 + info.rank)
    batches = [torch.randint(0, spec.config.vocab_size, (cfg.micro_batch_size, cfg.data.seq_len), generator=gen)]
    out = []
    for _ in range(steps):
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = _status("VmRSS")
        run_step(engine, batches)
        out.append(_status("VmHWM") - start)
    print("KERNEL " + json.dumps(out), flush=True)
    teardown()
    os._exit(0)


def kernel_peaks(overrides: list[str], steps: int = 3) -> list[int]:
    """Per step, the largest rank's VmHWM over its RSS at the step's start."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), __file__]
    cmd += ["--worker", json.dumps(overrides), "--steps", str(steps)]
    # glibc's dynamic mmap threshold would serve a freed large block's successors from the heap, which
    # it keeps: fixed thresholds hand every large block back on free, so RSS follows what is live.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="0")
    text = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600).stdout
    ranks = [json.loads(found) for found in re.findall(r"KERNEL (\[[^\]]*\])", text)]  # two ranks' lines may interleave
    return [max(r[i] for r in ranks) for i in range(steps)]


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=("llama", "gemma3"), default="llama")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.steps)
    heads = dict(num_attention_heads=4, num_key_value_heads=1 if args.family == "gemma3" else 2)
    if args.family == "gemma3":
        heads["head_dim"] = args.hidden // 4
    config = tied_config(args.family, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=2, **heads)
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        shape = [f"model.name={tmp}", "strategy=fsdp", "data.seq_len=128", "micro_batch_size=1"]
        runs = [[*shape, f"precision={p}", f"memory.loss_chunk_size={c}"] for p in ("bf16", "fp32") for c in (0, 32)]
        measured = launch(runs, 2, steps=2, allocator=True, trainer_view=True, timeout=900)
        print(f"{args.family}, hidden {args.hidden}, 2 layers, vocab {VOCAB:,} tied; FSDP2 x2 CPU, seq 128, micro 1 (MiB)\n")
        print(
            "| precision | loss chunk | plan | race | MemTracker step 1 / 2 | allocator | trainer's tracker | plan err "
            "| step peak over held: MemTracker | kernel VmHWM steps 1-3 |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for overrides, ranks in zip(runs, measured):
            est = estimate(load_config(None, overrides), 2, target="cpu")
            per_step = [max(r["per_step"][i] for r in ranks) for i in range(2)]
            truth = per_step[-1]
            held = ranks[0]["peak_by_category"]["optimizer_state"] + 4 * est.params_total // 2  # + the fp32 shards
            allocator = max(r["allocator_peak"] for r in ranks)
            trainer = max(r["trainer_tracker_peak"] or 0 for r in ranks)
            kernel = kernel_peaks(overrides)
            print(
                f"| {overrides[-2][10:]} | {overrides[-1].split('=')[1]} | {mib(est.total)} | {mib(est.race_bytes)} | "
                f"{mib(per_step[0])} / {mib(truth)} | {mib(allocator)} | {mib(trainer)} | {est.total / truth - 1:+.2%} | "
                f"{mib(truth - held)} | {' / '.join(mib(k) for k in kernel)} |",
                flush=True,
            )
        path = os.path.join(tmp, "g270")
        tied_config("gemma3", **GEMMA3_270M).save_pretrained(path)
        print("\nGemma-3-270M shape (config only), the same run, plan only (MiB):\n")
        print("| precision | plan | race | optimizer state | plan minus optimizer state | peak moment |")
        print("|---|---:|---:|---:|---:|---|")
        for precision in ("bf16", "fp32"):
            overrides = [f"model.name={path}", "strategy=fsdp", "data.seq_len=128", "micro_batch_size=1", f"precision={precision}"]
            est = estimate(load_config(None, overrides), 2, target="cpu")
            state = est.peak.categories["optimizer_state"]
            print(f"| {precision} | {mib(est.total)} | {mib(est.race_bytes)} | {mib(state)} | {mib(est.total - state)} | {est.peak.name} |")


if __name__ == "__main__":
    main()
