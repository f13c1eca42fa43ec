"""Probe memory per rank against that rank's shard, and GradProbe's wall time against Wanda's,
under FSDP2 and ZeRO-3 at world 1 and 2 (SmolLM2-135M; `prune_bench.py --model smollm2-135m`).

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/prune_memory.py --out runs/prune_memory

For each (strategy, world) one launch (`torchrun --nproc_per_node=W benchmarks/prune_memory.py
--rank-body ...`) builds the run as `python -m harness.prune` does (`harness.runner.build_run`,
the engine from the pre-flight plan), then, on the same dense model and calibration batches,
runs Wanda and then GradProbe (the veto, its first default), each followed by putting the dense weights back
(`snapshot_views` before, `restore_views` after, outside the measured window), so the second
method sees the same model. Per rank and method it records:

- `shard_bytes`: the bytes of parameters this rank stores (FSDP2: the local DTensor pieces;
  ZeRO-3: the `ds_tensor` partitions; world 1: the whole model);
- `ledger_peak_bytes`: the stage's own buffers (`PruneReport.peak_probe_bytes`: masks, G0/G1,
  pools, saved values; max over ranks);
- `rss_anon_peak_bytes`: the peak of this process's anonymous resident memory (`RssAnon` in
  /proc/self/status, sampled every 10 ms) above its value when the method started: everything the
  method allocated, transient selection keys, gradients and activations of the probe passes
  included (the file-backed pages of the memory-mapped safetensors are not in it);
- `wall_s`: the method's wall time (the same calibration batches, the same process).

Writes `<out>/<strategy>_w<world>.json` per launch and `<out>/summary.json`.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import prune_real  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from harness.config import RunConfig, load_config, load_strategy  # noqa: E402
from harness.distributed import Collectives, DistInfo, exit_process  # noqa: E402
from harness.engine import EnginePlan  # noqa: E402
from harness.pruning import build_views, restore_views, run_pruning, snapshot_views  # noqa: E402
from harness.runner import build_run, calibration_batches, calibration_split, preflight, run_command  # noqa: E402

METHODS = ("wanda", "gradprobe")
LIBC = ctypes.CDLL("libc.so.6")


def rss_anon() -> int:
    """This process's anonymous resident bytes (heap, tensors), without file-backed mappings."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Samples RssAnon every `period` s in a thread; `peak` is the highest value seen (a lower
    bound on the true peak: a spike shorter than the period can be missed)."""

    def __init__(self, period: float = 0.01) -> None:
        self.period, self.peak, self._stop = period, rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.period)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def shard_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds (its shard; the whole model when unsharded)."""
    total = 0
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3 partition
            total += p.ds_tensor.numel() * p.ds_tensor.element_size()
        elif isinstance(p, DTensor):
            local = p.to_local()
            total += local.numel() * local.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def rank_body(out: Path) -> Any:
    """The body each rank runs under `run_command`: both methods on the same dense model."""

    def body(cfg: RunConfig, plan: EnginePlan, info: DistInfo) -> None:
        trainer, _ = build_run(cfg, plan, info)
        engine, comm = trainer.engine, Collectives()
        samples, _ = calibration_split(trainer.data, cfg)
        batches = calibration_batches(samples, cfg, info, comm)
        grad_accum = None if engine.owns_grad_accumulation else cfg.grad_accum
        views = build_views(engine.model, cfg.prune.targets, comm)
        dense = snapshot_views(views)  # taken before the first start: in every method's baseline
        rows = []
        for method in METHODS:
            gc.collect()
            LIBC.malloc_trim(0)  # hand the heap the previous method freed back, so its pages do not hide this one's
            comm.barrier()  # the ranks start each method together: the wall time is the slowest rank's
            start = rss_anon()
            with engine.backward_without_step(), PeakSampler() as sampler:
                t0 = time.perf_counter()
                report = run_pruning(
                    engine.model,
                    batches,
                    dataclasses.replace(cfg.prune, method=method),
                    lambda _, b: engine.forward_loss(b),
                    grad_accum=grad_accum,
                    comm=comm,
                )
                wall = time.perf_counter() - t0
            restore_views(views, dense, comm)
            rows.append(
                {
                    "method": method,
                    "rank": info.rank,
                    "world": info.world_size,
                    "strategy": cfg.strategy,
                    "shard_bytes": shard_bytes(engine.module),
                    "ledger_peak_bytes": report.peak_probe_bytes,
                    "rss_anon_start_bytes": start,
                    "rss_anon_peak_bytes": sampler.peak - start,
                    "wall_s": wall,
                    "group_size": report.group_size,
                    "groups": report.groups,
                    "fwd_passes": report.fwd_passes,
                    "fwd_bwd_passes": report.fwd_bwd_passes,
                    "calib_samples": cfg.prune.calib_samples,
                    "micro_batch_size": cfg.micro_batch_size,
                    "target_numel": sum(int(m.numel()) for m in report.masks.masks.values()),
                }
            )
        (out / f"{cfg.strategy}_w{info.world_size}_rank{info.rank}.json").write_text(json.dumps(rows, indent=1))
        trainer.close()

    return body


def launch(out: Path, strategy: str, world: int, calib: int, micro_batch: int) -> list[dict[str, Any]]:
    """One torchrun launch of this file at `world` ranks; returns every rank's rows."""
    cfg = prune_real.real_config(out, calib, 256, 1)
    cfg.update(
        strategy=strategy,
        micro_batch_size=micro_batch,
        output_dir=str(out / f"{strategy}_w{world}"),
        checkpoint={"overwrite": True},
        prune={**cfg["prune"], "method": "gradprobe", "decision": "veto"},  # the veto, as measured in notes/pruning.md
    )
    path = out / f"{strategy}_w{world}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), f"--nproc_per_node={world}", f"--master_port={port}", __file__, "--rank-body", str(out), "--config", str(path)]
    env = {**prune_real._env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [row for r in range(world) for row in json.loads((out / f"{strategy}_w{world}_rank{r}.json").read_text())]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (strategy, world, method): the worst rank's ratios to its own shard, and GradProbe's
    time over Wanda's from the same launch."""
    out = []
    for strategy, world in dict.fromkeys((r["strategy"], r["world"]) for r in rows):
        group = [r for r in rows if r["strategy"] == strategy and r["world"] == world]
        wall = {m: max(r["wall_s"] for r in group if r["method"] == m) for m in METHODS}
        for m in METHODS:
            ranks = [r for r in group if r["method"] == m]
            out.append(
                {
                    "strategy": strategy,
                    "world": world,
                    "method": m,
                    "shard_mib": max(r["shard_bytes"] for r in ranks) / 2**20,
                    "ledger_peak_mib": max(r["ledger_peak_bytes"] for r in ranks) / 2**20,
                    "ledger_x_shard": max(r["ledger_peak_bytes"] / r["shard_bytes"] for r in ranks),
                    "rss_peak_mib": max(r["rss_anon_peak_bytes"] for r in ranks) / 2**20,
                    "rss_x_shard": max(r["rss_anon_peak_bytes"] / r["shard_bytes"] for r in ranks),
                    "wall_s": wall[m],
                    "x_wanda_time": wall[m] / wall["wanda"],
                    "group_size": ranks[0]["group_size"],
                    "fwd_bwd_passes": ranks[0]["fwd_bwd_passes"],
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/prune_memory")
    parser.add_argument("--calib-samples", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--runs", nargs="+", default=["fsdp:1", "fsdp:2", "zero3:1", "zero3:2"], metavar="STRATEGY:WORLD")
    parser.add_argument("--rank-body", default=None, help=argparse.SUPPRESS)  # set by the launch: run one rank
    args, rest = parser.parse_known_args(argv)
    if args.rank_body is not None:
        out = Path(args.rank_body)

        def load() -> tuple[RunConfig, EnginePlan]:
            cfg = load_config(rest[rest.index("--config") + 1], [])
            return cfg, preflight(cfg, load_strategy(cfg.strategy))

        return run_command("prune_memory", load, rank_body(out))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for spec in args.runs:
        strategy, world = spec.split(":")
        t0 = time.perf_counter()
        rows += launch(out, strategy, int(world), args.calib_samples, args.micro_batch)
        print(f"[memory] {spec}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        (out / "summary.json").write_text(json.dumps({"rows": rows, "summary": summarize(rows)}, indent=1))
    for r in summarize(rows):
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    exit_process(main())
