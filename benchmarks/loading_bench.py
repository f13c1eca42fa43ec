"""Per-rank private memory and time to first step while a ~300M model is loaded by many ranks.

    python benchmarks/loading_bench.py --work runs/loading --worlds 2 4 --strategies zero3 fsdp zero2 ddp \
        [--before /path/to/an/older/checkout] [--out benchmarks/results/loading/table.md]

A Llama of hidden 1024 and 24 layers is saved once as an fp32 safetensors checkpoint (with a
tokenizer trained on the embedded corpus). Each (code version, strategy, world) runs
`torchrun harness/train.py` on it for one step (and one eval batch). A monitor samples every rank's
``/proc/<pid>/status`` every 0.2 s:

- private memory = RssAnon (RSS minus file-backed and shared pages: the tensors a process
  owns; a memory-mapped safetensors file is in RssFile and can be dropped by the kernel);
- "before the first step" = the highest value up to the moment the run's metrics.jsonl
  appears (the observer writes its start record after the engine is built and the
  checkpoint restored, right before the first step); "run" = the highest value overall;
- time to first step = from the launch until that moment (imports, data, load, engine init).

`--before` runs the same matrix with another checkout's code (e.g. the commit before sharded
loading), in the same invocation, so both sides share the machine's conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
MODEL = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def save_model(work: Path, vocab_size: int) -> tuple[Path, int, int]:
    """The checkpoint directory (made once), its parameter count and its largest tensor's numel."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from harness.config import DataConfig
    from harness.data import load_packed, prepare_data

    model_dir = work / "llama-300m"
    if not (model_dir / "model.safetensors").exists():
        cache = load_packed(prepare_data("tiny-llama", DataConfig(vocab_size=vocab_size, cache_dir=str(work / "cache"), seq_len=64)))
        tokenizer = AutoTokenizer.from_pretrained(cache.tokenizer_dir)
        config = LlamaConfig(vocab_size=len(tokenizer), **MODEL)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        del model
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]
    numels = [int(__import__("math").prod(s)) for s in shapes]
    return model_dir, sum(numels), max(numels)


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def _workers(launcher_pid: int) -> list[int]:
    """torchrun's worker processes (its children running train.py), ordered by pid (= rank order)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children")
    try:
        pids = [int(p) for p in children.read_text().split()]
    except FileNotFoundError:
        return []
    return sorted(pids)


def run_one(code: Path, model_dir: Path, strategy: str, world: int, work: Path, steps: int = 1) -> dict:
    label = Path(strategy).stem
    out = work / "runs" / f"{code.name}-{label}-{world}-s{steps}"
    cfg = {
        "model": {"name": str(model_dir)},
        "data": {"seq_len": 64, "cache_dir": str(work / "cache")},
        "strategy": strategy,
        "precision": "fp32",
        "micro_batch_size": 1,
        "grad_accum": 1,
        "steps": steps,
        "eval_batches": 1,
        "optim": {"warmup_steps": 0},
        "logging": {"wandb": False, "progress": False, "plots": False},
        "memory": {"track": False},
        "output_dir": str(out),
        "checkpoint": {"overwrite": True},
    }
    path = work / f"{code.name}-{label}-{world}-s{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONPATH=str(code))
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        f"--nproc_per_node={world}",
        f"--master_port={port}",
        str(code / "harness" / "train.py"),
        "--config",
        str(path),
    ]
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    started = time.monotonic()
    log_path = out.with_suffix(".log")  # a file, not a pipe: a full pipe would stall the ranks
    out.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    before = [0] * world
    peak = [0] * world
    first_step_at = None
    while proc.poll() is None:
        pids = _workers(proc.pid)
        for rank, pid in enumerate(pids[:world]):
            anon = _status(pid).get("RssAnon", 0)
            peak[rank] = max(peak[rank], anon)
            if first_step_at is None:
                before[rank] = max(before[rank], anon)
        if first_step_at is None and metrics.exists():
            first_step_at = time.monotonic() - started
        time.sleep(0.2)
    log_file.close()
    log = log_path.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"{code.name} {strategy} x{world} exited {proc.returncode}:\n{log[-3000:]}")
    internal = [line.split("time to first step:")[1].strip() for line in log.splitlines() if "time to first step:" in line]
    return {
        "code": code.name,
        "strategy": label,
        "world": world,
        "steps": steps,
        "before_first_step": before,
        "run": peak,
        "to_first_step_s": first_step_at,
        "logged": internal[0] if internal else None,
        "wall_s": time.monotonic() - started,
    }


def load_peak_worker(model_dir: str, strategy: str, out: str) -> None:
    """One rank of `--tensor-peaks`: the load phase alone (`harness.engine.load_model`) under torch's
    MemTracker, so the peak is tensor bytes (what a GPU would hold), not pages."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from harness.config import load_config, load_strategy
    from harness.distributed import init_distributed
    from harness.engine import load_model, local_part
    from harness.models import model_spec
    from harness.training import precision_policy

    cfg = load_config(None, [f"model.name={model_dir}", f"strategy={strategy}", "precision=fp32", "micro_batch_size=1"])
    strat = load_strategy(cfg.strategy)
    info = init_distributed("cpu", force_group=True)
    tracker = MemTracker()
    started = time.perf_counter()
    with tracker:
        model = load_model(model_spec(model_dir), cfg, strat, precision_policy("fp32", info.device, strat.kind), info)
    seconds = time.perf_counter() - started
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    held = sum(local_part(p)[3].numel() * local_part(p)[3].element_size() for p in {id(p): p for p in model.parameters()}.values())
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"rank": info.rank, "peak": peak, "held": held, "seconds": seconds})
    if info.rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def tensor_peaks(model_dir: Path, strategies: list[str], worlds: list[int], work: Path) -> list[dict]:
    rows = []
    for world in worlds:
        for strategy in strategies:
            out = work / f"tensor-peak-{strategy}-{world}.json"
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            cmd = [
                str(Path(sys.executable).parent / "torchrun"),
                f"--nproc_per_node={world}",
                f"--master_port={port}",
                __file__,
                "--worker-load",
                str(model_dir),
                strategy,
                str(out),
            ]
            with open(out.with_suffix(".log"), "w") as log:
                subprocess.run(
                    cmd,
                    cwd=REPO,
                    env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    check=True,
                )
            ranks = json.loads(out.read_text())
            row = {
                "strategy": strategy,
                "world": world,
                "peak": max(r["peak"] for r in ranks),
                "held": max(r["held"] for r in ranks),
                "seconds": max(r["seconds"] for r in ranks),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict], params: int, largest: int) -> str:
    lines = [
        "| code | strategy | world | steps | private before step 1 (GiB, max rank) | target (GiB) | private over the run (GiB) | "
        "time to step 1 (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = ""
        if r["strategy"].startswith(("zero3", "fsdp")):
            target = f"{(params * 4 / r['world'] + largest * 4) / GIB:.2f} + baseline"
        before = max(r["before_first_step"]) / GIB
        lines.append(
            f"| {r['code']} | {r['strategy']} | {r['world']} | {r['steps']} | {before:.2f} | {target} | "
            f"{max(r['run']) / GIB:.2f} | {r['to_first_step_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "loading")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=["zero3", "fsdp", "zero2", "ddp"])
    parser.add_argument("--before", type=Path, default=None, help="another checkout to measure in the same invocation")
    parser.add_argument("--skip", nargs="*", default=[], help="strategy:world pairs to leave out (e.g. ddp:4 on a small host)")
    parser.add_argument("--steps", type=int, default=1, help="steps per run (ZeRO-3 keeps parameters gathered from step 2 on)")
    parser.add_argument("--after-only", nargs="*", default=[], help="strategies run with this checkout's code only")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tensor-peaks", action="store_true", help="also measure the load phase alone by tensor accounting")
    parser.add_argument("--worker-load", nargs=3, metavar=("MODEL_DIR", "STRATEGY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_load:
        load_peak_worker(*args.worker_load)
        return
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, params, largest = save_model(args.work, args.vocab_size)
    print(f"model: {model_dir} {params:,} parameters ({params * 4 / GIB:.2f} GiB fp32), largest tensor {largest:,}", flush=True)
    if args.tensor_peaks:
        peaks = tensor_peaks(model_dir, args.strategies, args.worlds, args.work)
        print("| strategy | world | load-phase peak, tensor bytes (GiB) | held after load (GiB) | whole model fp32 (GiB) | load (s) |")
        print("|---|---|---|---|---|---|")
        for r in peaks:
            print(
                f"| {r['strategy']} | {r['world']} | {r['peak'] / GIB:.3f} | {r['held'] / GIB:.3f} | {params * 4 / GIB:.3f} | "
                f"{r['seconds']:.1f} |"
            )
        return
    rows = []
    for world in args.worlds:
        for strategy in [*args.strategies, *args.after_only]:
            if f"{strategy}:{world}" in args.skip:
                continue
            for code in [c for c in (args.before, REPO) if c is not None and (c == REPO or strategy not in args.after_only)]:
                row = run_one(code.resolve(), model_dir, strategy, world, args.work, args.steps)
                print(json.dumps(row), flush=True)
                rows.append(row)
    text = (
        f"{platform.node()} ({os.cpu_count()} cores), {params:,}-parameter Llama (fp32 safetensors), "
        f"command: python {' '.join(sys.argv)}\n\n{table(rows, params, largest)}\n"
    )
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        (args.out.with_suffix(".json")).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
