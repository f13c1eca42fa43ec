"""harness's FSDP2 step time against a hand-written FSDP2 loop, at world 2, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/fsdp_loop_ratio.py [--models tiny-llama small-llama]
                                                           [--rounds 4] [--block 10]

Each model runs under `torchrun --nproc_per_node 2` (gloo, CPU). In one process per rank both
run over the same model preset, the same batches (harness's `BatchSampler`) and the same
AdamW: harness as `harness.train` builds it (`build_run`: `strategy=fsdp`, memory tracking
on as by default, `logging.log_every=10`, W&B and progress off; `--set key=value` changes it),
and a torchtitan-style loop (`fully_shard` on the embeddings, each decoder block, the head and the
root, HF's loss, gradient clipping, the loss and norm all-reduced and read only at log steps).
The two alternate in blocks of `--block` steps (a block holds one log step), `--rounds` times,
so a drift of the shared machine hits both alike; each block is timed whole (wall clock, after a
barrier), so whatever harness does per step (guard, logging, memory peaks) is inside. Reported:
each side's median seconds per step and the median over rounds of hand / harness (1.0: no
overhead; target >= 0.97), and the ratio of each side's fastest block (the least disturbed).

The script imports only `build_run`, `preflight`, `load_config`, `load_strategy`,
`run_command` and the data/model builders, so the same file measures an older checkout:
`PYTHONPATH=<checkout> python benchmarks/fsdp_loop_ratio.py`.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_config(model: str, out: Path, steps: int, overrides: list[str]) -> dict:
    raw = {
        "model": {"name": model},
        "strategy": "fsdp",
        "data": {"seq_len": 128, "vocab_size": 512 if model == "tiny-llama" else 4096},
        "micro_batch_size": 4 if model == "tiny-llama" else 2,
        "grad_accum": 2,
        "steps": steps,
        "eval_batches": 1,
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "logging": {"wandb": False, "progress": False, "plots": False, "log_every": 10},
        "output_dir": str(out),
    }
    for item in overrides:  # key.sub=value, YAML-typed: a diagnosis (e.g. memory.track=false)
        key, value = item.split("=", 1)
        *path, last = key.split(".")
        node = raw
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return raw


class HandLoop:
    """A torchtitan-style FSDP2 loop: no guard, no memory tracking, reads the loss at log steps only."""

    def __init__(self, cfg, data, rank: int, world: int) -> None:
        from torch.distributed.fsdp import fully_shard

        from harness.data import BatchSampler
        from harness.models import build_model

        self.model = build_model(cfg.model.name, vocab_size=data.vocab_size, seed=cfg.model.seed)
        # torchtitan's units: the embeddings, each block, the head (kept gathered after forward), the root
        embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        tied = head.weight is embed.weight
        if not tied:
            fully_shard(embed)
        for layer in self.model.model.layers:
            fully_shard(layer)
        if not tied:
            fully_shard(head, reshard_after_forward=False)
        fully_shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr, fused=True)
        self.sampler = BatchSampler(data, cfg.micro_batch_size, cfg.grad_accum, world, rank, cfg.data.seed)
        self.accum, self.clip, self.every = cfg.grad_accum, cfg.optim.grad_clip, cfg.logging.log_every
        self.world = world

    def step(self, step: int) -> None:
        losses = []
        for micro in range(self.accum):
            self.model.set_requires_gradient_sync(micro == self.accum - 1)
            x = self.sampler.batch(step, micro)
            loss = self.model(input_ids=x, labels=x).loss / self.accum
            loss.backward()
            losses.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if (step + 1) % self.every == 0:
            total = torch.stack([torch.stack(losses).sum(), norm.full_tensor()])
            dist.all_reduce(total)
            total.tolist()  # the log step's one read


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def run_sides(model: str, steps: int, block: int, overrides: list[str], measure: Callable[[Any, HandLoop, Any], dict]) -> dict:
    """In this rank (under torchrun): harness's trainer and the hand loop on the same run config
    and data, both warmed up by one block of steps, then `measure(trainer, hand, info)`; its dict."""
    from harness.config import load_config, load_strategy
    from harness.runner import build_run, preflight, run_command

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "run.yaml"
        config.write_text(yaml.safe_dump(run_config(model, Path(tmp) / "out", steps, overrides)))
        result: dict = {}

        def load():
            cfg = load_config(str(config), [])
            return cfg, preflight(cfg, load_strategy(cfg.strategy))

        def body(cfg, plan, info) -> None:
            trainer, _ = build_run(cfg, plan, info)
            hand = HandLoop(cfg, trainer.data, info.rank, info.world_size)
            trainer.train(0, block)  # warm-up, both sides (and the memory split's steps 0, 1)
            for s in range(block):
                hand.step(s)
            result.update(measure(trainer, hand, info))
            trainer.close()

        code = run_command("bench", load, body)
    if code != 0:
        raise SystemExit(code)
    return result


def worker(model: str, rounds: int, block: int, out_json: Path, overrides: list[str]) -> None:
    def measure(trainer, hand: HandLoop, _info) -> dict:
        h_times, b_times = [], []
        for r in range(1, rounds + 1):
            first = r * block
            h_times.append(timed(lambda: trainer.train(first, first + block)) / block)
            b_times.append(timed(lambda: [hand.step(s) for s in range(first, first + block)]) / block)
        return {"harness_s": h_times, "hand_s": b_times}

    result = run_sides(model, (rounds + 1) * block, block, overrides, measure)
    if int(os.environ.get("RANK", "0")) == 0:
        out_json.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "small-llama"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--set", nargs="*", default=[], help="harness config overrides, key=value (a diagnosis)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.block, Path(args.out), args.set)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    print("| model | harness s/step | hand loop s/step | hand / harness: median of rounds (min, max) | best blocks | rounds |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29571"]
            cmd += [__file__, "--worker", model, "--rounds", str(args.rounds), "--block", str(args.block), "--out", str(out)]
            cmd += ["--set", *args.set]
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            r = json.loads(out.read_text())
        ratios = [b / h for h, b in zip(r["harness_s"], r["hand_s"])]
        best = min(r["hand_s"]) / min(r["harness_s"])  # each side's least-disturbed block
        print(
            f"| {model} | {statistics.median(r['harness_s']):.4f} | {statistics.median(r['hand_s']):.4f} "
            f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}, {max(ratios):.3f}) | {best:.3f} | {len(ratios)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
