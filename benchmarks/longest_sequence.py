"""The longest sequence a memory budget trains SmolLM2 at, per long-sequence knob: measured by
bisection of real steps under a hard memory cap, beside `harness.plan --max-seq-len`'s answer.

    sudo-less root on Linux with cgroup v1 memory (this machine):
    python benchmarks/longest_sequence.py --cap-gib 3.5 > table.md

Each probe is two real training steps (the second holds AdamW's states beside the activations;
`python -m harness.planner.measure`: the trainer's engine,
loss and memory techniques, fp32, AdamW, one rank) run inside a memory cgroup whose limit is the
cap (no swap on this machine): a step that needs more is killed by the kernel, so "fits" is the
machine's own verdict, not a tracker's. The cap covers the whole process (interpreter, libraries,
allocator slack), the planner counts tensors: the planner is asked with the cap minus that
overhead, measured at the first knob's longest fitting step (bisected without the planner): the
cgroup's peak, less the file pages still charged to it afterwards (page cache, which the kernel
reclaims before it kills), less the allocator's peak. The other knobs test the planner with it.
Each probe starts with the cgroup emptied of cache, and runs with glibc's mmap threshold fixed
(`GLIBC`).

The search per knob starts at the planner's answer and walks by the planner's step (256 tokens)
until the boundary is bracketed (the longest length that fits, and that plus one step killed), then
bisects. Why a cap and not the machine's 24 GiB: at 24 GiB the answers are tens of thousands of
tokens, where one SmolLM2 step on 2 CPU cores takes many minutes (attention is quadratic); the cap
keeps every probe under two minutes and the question is the same one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CGROUP = Path("/sys/fs/cgroup/memory/harness_longest_sequence")
STEP = 256
# glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after which
# freed activations stay in the heap: with recomputation at 2,048 tokens the process's peak RSS was
# 4.78 GB against the allocator's 2.34 GB. A fixed threshold returns every block of 1 MiB or more to
# the kernel when torch frees it (peak RSS 2.72 GB), so the cap measures tensors, not glibc's cache.
GLIBC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
KNOBS = {
    "none": [],
    "chunked loss": ["memory.loss_chunk_size=1024"],
    "AC + chunked loss": ["memory.activation_checkpointing=full", "memory.loss_chunk_size=1024"],
    "AC + chunked loss + tiled MLP": [
        "memory.activation_checkpointing=full",
        "memory.loss_chunk_size=1024",
        "memory.tiled_mlp_tokens=1024",
    ],
}


def base_overrides(model: str) -> list[str]:
    return [f"model.name={model}", "strategy=ddp", "precision=fp32", "micro_batch_size=1", "grad_accum=1", "optim.name=adamw"]


def make_cgroup(cap: int) -> None:
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.swappiness").write_text("0")
    (CGROUP / "memory.limit_in_bytes").write_text(str(cap))


def step_under_cap(overrides: list[str], seq: int, timeout: float) -> dict:
    """One real step at `seq` tokens inside the cgroup: fits (exit 0), the cgroup's peak bytes, the
    allocator's peak (when it fits) and the seconds it took."""
    (CGROUP / "memory.force_empty").write_text("0")  # the page cache an earlier probe left charged here
    (CGROUP / "memory.max_usage_in_bytes").write_text("0")
    failcnt = int((CGROUP / "memory.failcnt").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        runs, out = Path(tmp) / "runs.json", Path(tmp) / "out.json"
        runs.write_text(json.dumps([[*overrides, f"data.seq_len={seq}"]]))
        cmd = (
            f"echo $$ > {CGROUP}/cgroup.procs && exec {sys.executable} -m harness.planner.measure --runs {runs} --out {out} "
            "--steps 2 --no-trainer-view --allocator --no-dispatch"
        )
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), **GLIBC)
        started = time.perf_counter()
        proc = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
        seconds = time.perf_counter() - started
        peak = int((CGROUP / "memory.max_usage_in_bytes").read_text())
        stat = dict(line.split() for line in (CGROUP / "memory.stat").read_text().splitlines())
        cache = int(stat["cache"])  # file pages still charged after the process left (the weights file, libraries)
        hit = int((CGROUP / "memory.failcnt").read_text()) > failcnt
        result = json.loads(out.read_text())[0][0] if proc.returncode == 0 and out.exists() else None
    if proc.returncode != 0 and proc.returncode not in (-9, 137) and not hit:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise RuntimeError(f"seq {seq}: failed for another reason than memory (rc={proc.returncode}):\n{tail}")
    allocator = result.get("allocator_peak") if result else None
    fits = proc.returncode == 0
    return {"seq": seq, "fits": fits, "cgroup_peak": peak, "cache": cache, "allocator_peak": allocator, "seconds": round(seconds, 1)}


def planned_longest(overrides: list[str], budget: int) -> int:
    """`harness.plan --max-seq-len` for one rank on a CPU with `budget` bytes for tensors."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "harness.plan", "--gpus", "1", "--gpu-mem", str(budget), "--target", "cpu"]
        cmd += ["--max-seq-len", "--seq-step", str(STEP), "--json", str(out), *overrides, f"data.seq_len={STEP}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
        if not out.exists():
            raise RuntimeError(f"harness.plan failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")
        return int(json.loads(out.read_text())["max_seq_len"])


def measured_longest(overrides: list[str], start: int, timeout: float, log: list[dict]) -> int:
    """Bracket the boundary from `start` by steps of STEP, then bisect: the longest multiple of STEP that fits."""

    def probe(seq: int) -> bool:
        r = step_under_cap(overrides, seq, timeout)
        log.append(r)
        print(f"  {json.dumps(r)}", file=sys.stderr, flush=True)
        return r["fits"]

    seq = max(STEP, start)
    if probe(seq):
        lo, hi, jump = seq, None, STEP
        while hi is None:
            nxt = lo + jump
            if probe(nxt):
                lo, jump = nxt, jump * 2
            else:
                hi = nxt
    else:
        hi, lo, jump = seq, None, STEP
        while lo is None:
            nxt = max(STEP, hi - jump)
            if probe(nxt):
                lo = nxt
            elif nxt == STEP:
                return 0
            else:
                hi, jump = nxt, jump * 2
    while hi - lo > STEP:
        middle = (lo + hi) // 2 // STEP * STEP
        lo, hi = (middle, hi) if probe(middle) else (lo, middle)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: benchmarks/real_model.py's SmolLM2)")
    parser.add_argument("--cap-gib", type=float, default=3.5)
    parser.add_argument("--knobs", nargs="+", default=list(KNOBS), choices=list(KNOBS))
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.model is None:
        real = subprocess.run([sys.executable, str(REPO / "benchmarks" / "real_model.py")], capture_output=True, text=True, check=True)
        args.model = json.loads(real.stdout.splitlines()[-1])["model_dir"]
    model = args.model
    cap = int(args.cap_gib * 2**30)
    base = base_overrides(model)
    make_cgroup(cap)
    # The first knob is bisected without the planner; the process's bytes beyond the allocator's at
    # its longest fitting step (the regime of the boundary, under the cap) are the overhead the planner
    # is given for every knob. The first knob's row checks that calibration; the others test the planner.
    first, *rest = args.knobs
    log: list[dict] = []
    measured = measured_longest(base + KNOBS[first], 2 * STEP, args.timeout, log)
    at = next(p for p in log if p["fits"] and p["seq"] == measured)
    overhead = at["cgroup_peak"] - at["cache"] - at["allocator_peak"]
    print(
        f"overhead at {measured} tokens ({first}): {at['cgroup_peak']:,} - {at['cache']:,} - {at['allocator_peak']:,} = {overhead:,}",
        file=sys.stderr,
    )
    rows = [{"knob": first, "planned": planned_longest(base + KNOBS[first], cap - overhead), "measured": measured, "probes": log}]
    for name in rest:
        overrides = base + KNOBS[name]
        planned = planned_longest(overrides, cap - overhead)
        print(f"{name}: planner {planned}", file=sys.stderr, flush=True)
        log = []
        measured = measured_longest(overrides, planned, args.timeout, log)
        rows.append({"knob": name, "planned": planned, "measured": measured, "probes": log})
    print(f"SmolLM2-135M (fp32, AdamW, micro-batch 1, one rank), cap {args.cap_gib} GiB, overhead {overhead / 2**20:.0f} MiB\n")
    print(
        "| knobs | planner's longest (cap - overhead) | measured longest (killed one step beyond) | planner / measured "
        "| probes (seq: fits, s) |"
    )
    print("|---|---:|---:|---:|---|")
    for r in rows:
        probes = ", ".join(f"{p['seq']}: {'yes' if p['fits'] else 'no'} {p['seconds']:.0f}" for p in r["probes"])
        ratio = f"{r['planned'] / r['measured']:.3f}" if r["measured"] else "-"
        print(f"| {r['knob']} | {r['planned']:,} | {r['measured']:,} | {ratio} | {probes} |")
    print("\n" + json.dumps({"cap": cap, "overhead": overhead, "rows": rows}))


if __name__ == "__main__":
    main()
