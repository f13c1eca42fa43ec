"""How long planning a Llama-3-8B-shaped run for 8 ranks takes, and how much host memory it needs.

    python benchmarks/plan_speed.py [--seq-len 8192] [--repeat 1]

Each configuration is planned by a fresh ``python -m harness.plan`` process (imports, fake
model build, trace, report: what a user waits for), timed by wall clock, with the child's
peak resident memory from ``wait4``. Target: < 60 s and < 2 GB on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [
    ("fsdp", "bf16", "full"),
    ("fsdp", "bf16", "none"),
    ("fsdp_grad_op", "bf16", "selective"),
    ("zero3", "bf16", "full"),
    ("zero2", "bf16", "op"),
    ("zero3_offload", "bf16", "full"),
    ("ddp", "fp32", "none"),
]


def plan_once(strategy: str, precision: str, ac: str, seq_len: int, gpu_mem: str) -> tuple[float, int, int, str]:
    """(wall seconds, child peak RSS bytes, exit code, the report's peak line) of one planning process."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "harness.plan",
            "--gpus",
            "8",
            "--gpu-mem",
            gpu_mem,
            "--vocab-size",
            "128256",
            "model.name=llama3-8b",
            f"strategy={strategy}",
            f"precision={precision}",
            f"memory.activation_checkpointing={ac}",
            "micro_batch_size=1",
            f"data.seq_len={seq_len}",
        ]
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        start = time.perf_counter()
        with open(os.path.join(tmp, "stderr"), "w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=tmp)
            out = proc.stdout.read() if proc.stdout else ""
            _, status, usage = os.wait4(proc.pid, 0)  # reap it ourselves: wait4 gives this child's own peak RSS
            wall = time.perf_counter() - start
            proc.returncode = os.waitstatus_to_exitcode(status)
            err.seek(0)
            if proc.returncode not in (0, 10):  # fits / does not fit (harness/errors.py); anything else: show why
                print(err.read()[-2000:], file=sys.stderr)
    rss = int(usage.ru_maxrss * 1024)
    peak = next((line for line in out.splitlines() if line.startswith("Per-rank peak")), "(no report)")
    return wall, rss, proc.returncode, peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--gpu-mem", default="80GiB")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"Llama-3-8B shape (preset llama3-8b, vocab 128256), 8 ranks, micro-batch 1 x seq {args.seq_len}\n")
    print("| strategy | precision | AC | wall s | peak RSS MB | exit | predicted per-rank peak |")
    print("|---|---|---|---:|---:|---:|---|")
    for strategy, precision, ac in CONFIGS:
        wall, rss, code, peak = plan_once(strategy, precision, ac, args.seq_len, args.gpu_mem)
        peak = peak.split(": ", 1)[-1]
        print(f"| {strategy} | {precision} | {ac} | {wall:.1f} | {rss / 1e6:.0f} | {code} | {peak} |", flush=True)


if __name__ == "__main__":
    main()
