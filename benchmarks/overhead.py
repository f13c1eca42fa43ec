"""Harness overhead: the same training run by a minimal hand-written loop and by harness.

    python benchmarks/overhead.py [--model small-llama|<model dir>] [--steps 30] [--precision fp32]
                                  [--modes defaults track-off split-every-step]

Both use the same model, data blocks, batch and optimizer on one process; the hand loop is
nanoGPT-style (HF loss, AdamW, no logging). harness runs as users run it (`python -m
harness.train`, W&B off, progress on), once per memory mode: `defaults` (what a user gets:
the peak counters every step, the category split on steps 0 and 1 and every 100th),
`track-off` (`memory.track=false`) and `split-every-step` (`memory.track_every=1`, the
default before the split was sampled). Reported per mode: median samples/s over the steps
after two warm-up steps, and the ratio harness / hand loop (target >= 0.97); the hand loop
runs before and after the harness runs, and its spread is the machine's drift.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from harness.config import load_config
from harness.data import BatchSampler, load_packed, prepare_data
from harness.models import build_model

REPO = Path(__file__).resolve().parents[1]


def hand_loop(cfg, steps: int) -> float:
    data = load_packed(prepare_data(cfg.model.name, cfg.data))
    model = build_model(cfg.model.name, vocab_size=data.vocab_size, seed=cfg.model.seed)
    if cfg.precision == "bf16":
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, fused=True)  # as nanoGPT and harness build it
    sampler = BatchSampler(data, cfg.micro_batch_size, 1, 1, 0, cfg.data.seed)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x = sampler.batch(step, 0)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return cfg.micro_batch_size / statistics.median(times[2:])


MEMORY_MODES = {"defaults": {}, "track-off": {"track": False}, "split-every-step": {"track_every": 1}}


def harness_run(config: Path, out: Path) -> float:
    env = dict(os.environ, WANDB_MODE="disabled")
    subprocess.run([sys.executable, "-m", "harness.train", "--config", str(config)], cwd=REPO, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["perf/samples_per_s"] for r in rows if r.get("kind") == "train" and r["step"] > 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--modes", nargs="+", choices=list(MEMORY_MODES), default=list(MEMORY_MODES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = {
            "model": {"name": args.model},
            "data": {"seq_len": 256, "vocab_size": 4096},
            "micro_batch_size": 4,
            "steps": args.steps,
            "eval_batches": 1,
            "precision": args.precision,
            "optim": {"grad_clip": 0.0, "warmup_steps": 0, "schedule": "constant"},
            "logging": {"wandb": False, "plots": False},
        }
        base = Path(tmp) / "hand.yaml"
        base.write_text(yaml.safe_dump({**raw, "output_dir": str(Path(tmp) / "hand")}))
        cfg = load_config(str(base))
        hand = hand_loop(cfg, args.steps)
        ours = {}
        for mode in args.modes:
            out = Path(tmp) / mode
            config = Path(tmp) / f"{mode}.yaml"
            config.write_text(yaml.safe_dump({**raw, "memory": MEMORY_MODES[mode], "output_dir": str(out)}))
            ours[mode] = harness_run(config, out)
        hand2 = hand_loop(cfg, args.steps)  # again: the machine's drift shows in the spread
    for mode, value in ours.items():
        print(
            f"| {args.model} | {args.precision} | {min(hand, hand2):.3f}–{max(hand, hand2):.3f} | {mode} | {value:.3f} | "
            f"{value / statistics.mean([hand, hand2]):.3f} |"
        )


if __name__ == "__main__":
    main()
