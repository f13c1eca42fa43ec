"""A rank's CPU and garbage-collector time for a short run, this tree against another commit's.

    OMP_NUM_THREADS=1 python benchmarks/startup_gc.py --baseline 40a2021 [--repeats 3] [--strategy zero2]

Both trees run the same tiny-llama config (`torchrun --nproc_per_node=2 <tree>/harness/train.py`, 3
steps, the embedded corpus, tracking off), alternating, `--repeats` times each; the baseline tree
is a `git worktree` of `--baseline`, made in a temporary folder and removed after. Each rank
reports, at exit, its CPU seconds (user + system) and the collector's seconds and collections per
generation (`gc.callbacks`, installed by a `sitecustomize` on PYTHONPATH: the same instrument in
both trees). Prints a markdown table of the per-rank medians and both trees' final losses (which
must be equal: the collector changes when memory is freed, never a number).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from harness.distributed import free_port

REPO = Path(__file__).resolve().parents[1]

SITECUSTOMIZE = """
import atexit, gc, json, os, resource, sys, time
_gc = {"s": [0.0, 0.0, 0.0], "n": [0, 0, 0], "t": 0.0}
def _cb(phase, info):
    if phase == "start":
        _gc["t"] = time.perf_counter()
    else:
        g = info["generation"]; _gc["s"][g] += time.perf_counter() - _gc["t"]; _gc["n"][g] += 1
gc.callbacks.append(_cb)
def _report():
    if "train.py" not in " ".join(sys.argv):
        return
    u = resource.getrusage(resource.RUSAGE_SELF)
    with open(os.environ["STARTUP_GC_OUT"], "a") as f:
        f.write(json.dumps({"cpu": u.ru_utime + u.ru_stime, "gc_s": _gc["s"], "gc_n": _gc["n"]}) + "\\n")
atexit.register(_report)
_exit = os._exit
def _reporting_exit(code):
    _report(); _exit(code)
os._exit = _reporting_exit
"""


def run_once(tree: Path, config: Path, strategy: str, work: Path, tag: str) -> tuple[list[dict], float]:
    out_dir, report = work / f"out_{tag}", work / f"report_{tag}.jsonl"
    env = dict(os.environ, PYTHONPATH=str(work / "site"), STARTUP_GC_OUT=str(report), WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    cmd += [str(tree / "harness" / "train.py")]
    cmd += ["--config", str(config), f"strategy={strategy}", f"output_dir={out_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    ranks = [json.loads(line) for line in report.read_text().splitlines()]
    losses = [json.loads(line)["train/loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in line]
    return ranks, losses[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the commit to compare with (a worktree of it is made)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategy", default="zero2")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        base = work / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(base), args.baseline], check=True)
        try:
            cfg = {
                "model": {"name": "tiny-llama"},
                "data": {"seq_len": 32, "max_tokens": 20000, "vocab_size": 512, "cache_dir": str(work / "cache")},
                "micro_batch_size": 2,
                "steps": 3,
                "eval_batches": 1,
                "logging": {"wandb": False, "progress": False, "plots": False},
                "memory": {"track": False},
            }
            config = work / "run.yaml"
            config.write_text(yaml.safe_dump(cfg))
            rows: dict[str, list[dict]] = {"this tree": [], args.baseline: []}
            final: dict[str, set[float]] = {"this tree": set(), args.baseline: set()}
            for i in range(args.repeats):
                for name, tree in (("this tree", REPO), (args.baseline, base)):
                    ranks, loss = run_once(tree, config, args.strategy, work, f"{i}_{tree.name}")
                    rows[name] += ranks
                    final[name].add(loss)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    what = f"`torchrun --nproc_per_node=2 harness/train.py`, tiny-llama, {args.strategy}, 3 steps"
    print(f"{what}; per rank, the median of {args.repeats} runs x 2 ranks\n")
    print("| tree | CPU s | GC s (gen 0 / 1 / 2) | collections (gen 0 / 1 / 2) | final train loss |")
    print("|---|---:|---|---|---|")
    for name, ranks in rows.items():
        cpu = statistics.median(r["cpu"] for r in ranks)
        gc_s = [statistics.median(r["gc_s"][g] for r in ranks) for g in range(3)]
        gc_n = [statistics.median(r["gc_n"][g] for r in ranks) for g in range(3)]
        losses = ", ".join(f"{x:.6f}" for x in sorted(final[name]))
        print(f"| {name} | {cpu:.2f} | {' / '.join(f'{s:.2f}' for s in gc_s)} | {' / '.join(f'{n:g}' for n in gc_n)} | {losses} |")


if __name__ == "__main__":
    main()
