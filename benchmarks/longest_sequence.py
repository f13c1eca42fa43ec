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
bisects.

`--ranks N` runs the split rows instead: N ranks under FSDP2 (states sharded alike), each rank in
its own cgroup with the cap (a GPU's memory is per rank), whole sequences then `parallel.sequence=N`
(SmolLM2 has 9 heads and 3 key/value heads: N=3). A rank the kernel kills is a probe that does not
fit, and its peers are stopped. The planner is asked for N ranks of the cap less the overhead,
calibrated at the first row's boundary as above:

    python benchmarks/longest_sequence.py --ranks 3 --cap-gib 1.8 --timeout 2400 > table.md

`--overhead BYTES` gives an earlier run's calibration instead of bisecting the first row again
(the split row alone: `--ranks 3 --cap-gib 1.8 --overhead 290818328`).

Why a cap and not the machine's 24 GiB: at 24 GiB the answers are tens of thousands of
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

from harness.distributed import free_port

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


def split_knobs(ranks: int) -> dict[str, list[str]]:
    """Several ranks, FSDP2 (the states sharded alike in both rows): whole sequences, then each
    sequence split over every rank (Ulysses; SmolLM2's 9 heads and 3 key/value heads take 3)."""
    whole = ["strategy=fsdp", "memory.activation_checkpointing=full", "memory.loss_chunk_size=1024"]
    return {f"{ranks} ranks, FSDP2, AC + chunked loss": whole, f"... + parallel.sequence={ranks}": [*whole, f"parallel.sequence={ranks}"]}


def base_overrides(model: str) -> list[str]:
    return [f"model.name={model}", "strategy=ddp", "precision=fp32", "micro_batch_size=1", "grad_accum=1", "optim.name=adamw"]


def cgroups(world: int) -> list[Path]:
    """One memory cgroup per rank: the cap is per rank, as a GPU's memory is."""
    return [CGROUP] if world == 1 else [CGROUP.with_name(f"{CGROUP.name}_rank{r}") for r in range(world)]


def make_cgroups(cap: int, world: int) -> None:
    for group in cgroups(world):
        group.mkdir(exist_ok=True)
        (group / "memory.swappiness").write_text("0")
        (group / "memory.limit_in_bytes").write_text(str(cap))


def step_under_cap(overrides: list[str], seq: int, timeout: float, world: int = 1) -> dict:
    """One real step at `seq` tokens, each of `world` ranks inside its own cgroup: fits (every rank
    exits 0), the largest rank's cgroup peak, its file cache, the largest allocator peak (when it
    fits) and the seconds it took. A rank the kernel kills leaves its peers waiting in a collective:
    they are stopped at once."""
    groups = cgroups(world)
    failcnt = []
    for group in groups:
        (group / "memory.force_empty").write_text("0")  # the page cache an earlier probe left charged here
        (group / "memory.max_usage_in_bytes").write_text("0")
        failcnt.append(int((group / "memory.failcnt").read_text()))
    with tempfile.TemporaryDirectory() as tmp:
        runs, out = Path(tmp) / "runs.json", Path(tmp) / "out.json"
        runs.write_text(json.dumps([[*overrides, f"data.seq_len={seq}"]]))
        threads = os.environ.get("OMP_NUM_THREADS", "2" if world == 1 else "1")
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=threads, **GLIBC)
        if world > 1:
            env |= {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        started = time.perf_counter()
        procs = []
        for rank, group in enumerate(groups):
            cmd = (
                f"echo $$ > {group}/cgroup.procs && exec {sys.executable} -m harness.planner.measure --runs {runs} --out {out} "
                "--steps 2 --no-trainer-view --allocator --no-dispatch"
            )
            rank_env = env | ({"RANK": str(rank), "LOCAL_RANK": str(rank)} if world > 1 else {})
            procs.append(
                subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=rank_env, cwd=tmp)
            )
        codes = _wait_all(procs, timeout)
        seconds = time.perf_counter() - started
        logs = [p.stdout.read() if p.stdout else "" for p in procs]
        peaks, caches = [], []
        for group in groups:
            peaks.append(int((group / "memory.max_usage_in_bytes").read_text()))
            stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
            caches.append(int(stat["cache"]))  # file pages still charged after the process left (the weights file, libraries)
        hit = any(int((g / "memory.failcnt").read_text()) > before for g, before in zip(groups, failcnt))
        fits = all(code == 0 for code in codes)
        result = json.loads(out.read_text())[0] if fits and out.exists() else None
    killed = any(code in (-9, 137) for code in codes)
    if not fits and not killed and not hit:
        raise RuntimeError(f"seq {seq}: failed for another reason than memory (exit codes {codes}):\n{logs[0][-2000:]}")
    top = max(range(world), key=lambda r: peaks[r])
    allocator = max(rank.get("allocator_peak") or 0 for rank in result) if result else None
    return {
        "seq": seq,
        "fits": fits,
        "cgroup_peak": peaks[top],
        "cache": caches[top],
        "allocator_peak": allocator,
        "seconds": round(seconds, 1),
    }


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Every rank's exit code; once one fails, the rest are killed (they would wait on it for ever)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.5)
    return [p.wait() for p in procs]


def planned_longest(overrides: list[str], budget: int, world: int = 1, step: int = STEP) -> int:
    """`harness.plan --max-seq-len` for `world` ranks on CPUs with `budget` bytes for tensors each."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "harness.plan", "--gpus", str(world), "--gpu-mem", str(budget), "--target", "cpu"]
        cmd += ["--max-seq-len", "--seq-step", str(step), "--json", str(out), *overrides, f"data.seq_len={step}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
        if not out.exists():
            raise RuntimeError(f"harness.plan failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")
        return int(json.loads(out.read_text())["max_seq_len"])


def measured_longest(overrides: list[str], start: int, timeout: float, log: list[dict], world: int = 1, step: int = STEP) -> int:
    """Bracket the boundary from `start` by steps of `step`, then bisect: the longest multiple of `step` that fits."""

    def probe(seq: int) -> bool:
        r = step_under_cap(overrides, seq, timeout, world)
        log.append(r)
        print(f"  {json.dumps(r)}", file=sys.stderr, flush=True)
        return r["fits"]

    seq = max(step, start)
    if probe(seq):
        lo, hi, jump = seq, None, step
        while hi is None:
            nxt = lo + jump
            if probe(nxt):
                lo, jump = nxt, jump * 2
            else:
                hi = nxt
    else:
        hi, lo, jump = seq, None, step
        while lo is None:
            nxt = max(step, hi - jump)
            if probe(nxt):
                lo = nxt
            elif nxt == step:
                return 0
            else:
                hi, jump = nxt, jump * 2
    while hi - lo > step:
        middle = (lo + hi) // 2 // step * step
        lo, hi = (middle, hi) if probe(middle) else (lo, middle)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: benchmarks/real_model.py's SmolLM2)")
    parser.add_argument("--cap-gib", type=float, default=3.5)
    parser.add_argument("--knobs", nargs="+", default=list(KNOBS), choices=list(KNOBS))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--ranks", type=int, default=1, help="N > 1: the split rows instead (N ranks, each under the cap)")
    parser.add_argument(
        "--overhead", type=int, default=None, help="bytes per rank an earlier run's first row measured: that row is not bisected again"
    )
    args = parser.parse_args()
    if args.model is None:
        real = subprocess.run([sys.executable, str(REPO / "benchmarks" / "real_model.py")], capture_output=True, text=True, check=True)
        args.model = json.loads(real.stdout.splitlines()[-1])["model_dir"]
    model = args.model
    cap = int(args.cap_gib * 2**30)
    base = base_overrides(model)
    world = args.ranks
    knobs = KNOBS if world == 1 else split_knobs(world)
    names = args.knobs if world == 1 else list(knobs)

    def step_of(name: str) -> int:  # a split's length is a multiple of its degree
        return STEP * world if "parallel.sequence" in " ".join(knobs[name]) else STEP

    make_cgroups(cap, world)
    # The first knob is bisected without the planner; the process's bytes beyond the allocator's at
    # its longest fitting step (the regime of the boundary, under the cap) are the overhead the planner
    # is given for every knob. The first knob's row checks that calibration; the others test the planner.
    first, *rest = names
    if args.overhead is None:
        log: list[dict] = []
        measured = measured_longest(base + knobs[first], 2 * STEP, args.timeout, log, world, step_of(first))
        if not measured:
            raise SystemExit(f"{first}: not even {step_of(first)} tokens fit under {args.cap_gib} GiB per rank; raise --cap-gib")
        at = next(p for p in log if p["fits"] and p["seq"] == measured)
        overhead = at["cgroup_peak"] - at["cache"] - at["allocator_peak"]
        print(
            f"overhead at {measured} tokens ({first}): {at['cgroup_peak']:,} - {at['cache']:,} - {at['allocator_peak']:,} = {overhead:,}",
            file=sys.stderr,
        )
        planned = planned_longest(base + knobs[first], cap - overhead, world, step_of(first))
        rows = [{"knob": first, "planned": planned, "measured": measured, "probes": log}]
    else:  # the calibration row was bisected by an earlier run: its overhead is given
        overhead, rows = args.overhead, []
    for name in rest:
        overrides = base + knobs[name]
        planned = planned_longest(overrides, cap - overhead, world, step_of(name))
        print(f"{name}: planner {planned}", file=sys.stderr, flush=True)
        log = []
        measured = measured_longest(overrides, planned, args.timeout, log, world, step_of(name))
        rows.append({"knob": name, "planned": planned, "measured": measured, "probes": log})
    who = "one rank" if world == 1 else f"{world} ranks, each under the cap"
    print(f"SmolLM2-135M (fp32, AdamW, micro-batch 1, {who}), cap {args.cap_gib} GiB, overhead {overhead / 2**20:.0f} MiB\n")
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
