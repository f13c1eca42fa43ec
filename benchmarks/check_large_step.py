"""`harness.train --check` at a step of 131,072 tokens: correct runs pass, planted bugs are named.

The suite checks a 512-token step (`tests/integration/test_check.py`); the bounds must also hold
where a step is large, the case a review found the worst-case bounds losing bugs in. Each case is
one torchrun launch of 2 gloo ranks through `tests/integration/planted_check.py` (the bug planted by
`HARNESS_TEST_PLANT`) on the suite's tied Llama (515-row vocabulary, sharded unevenly), packed
instruction data (20,000 records), 64-token blocks, micro-batch 512 x grad_accum 2 x 2 ranks.
Prints one markdown row per case: exit code, the verdict line's first difference (or the
largest step-1 gradient error and its bound), the quantity nearest its bound, and the wall time.

    OMP_NUM_THREADS=1 python benchmarks/check_large_step.py --cases none-fsdp-bf16 unreduced-ddp-bf16 packing_leak-ddp-bf16

Cases are `<plant>-<strategy>-<precision>`; plants: none, unreduced, accum_scale, tied_not_updated,
packing_leak (`planted_check.py`). About 1.5 minutes a case on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from harness.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
PLANTED = REPO / "tests" / "integration" / "planted_check.py"
CASES = ["none-fsdp-bf16", "unreduced-ddp-bf16", "none-fsdp-fp32", "unreduced-ddp-fp32", "packing_leak-ddp-bf16"]


def build_inputs(root: Path, records: int, micro_batch: int, seq_len: int) -> Path:
    """The tied twin's model directory, the instruction file and the run config (the suite's own
    helpers, `tests/launching.py`); the config's path."""
    sys.path.insert(0, str(REPO / "tests"))
    from launching import instruction_file, tied_llama

    model = tied_llama(root / "tied-llama")
    data = instruction_file(root / "sft.jsonl", records)
    cfg = {
        "model": {"name": str(model)},
        "data": {"source": str(data), "format": "instruction", "packing": True, "seq_len": seq_len, "cache_dir": str(root / "cache")},
        "micro_batch_size": micro_batch,
        "grad_accum": 2,
        "optim": {"lr": 0.01, "warmup_steps": 1},
        "logging": {"wandb": False, "progress": False, "plots": False},
        "memory": {"track": False},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_case(case: str, config: Path, root: Path) -> dict:
    plant, strategy, precision = case.split("-")
    env = {**os.environ, "HARNESS_TEST_PLANT": plant, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", str(PLANTED), "--config", str(config), "--check"]
    cmd += [f"strategy={strategy}", f"precision={precision}", f"output_dir={root / ('out-' + case)}"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    seconds = time.perf_counter() - started
    out = proc.stdout + proc.stderr
    verdict = next((x for x in out.splitlines() if x.startswith(("[harness] check passed", "[harness] check failed"))), "")
    errors = next((x for x in out.splitlines() if "largest relative errors" in x), verdict)
    first = re.search(r"step \d+ \w+ of \S+ differs .*?bound [\d.e+-]+", verdict)
    step1 = re.search(r"step 1 gradient ([\d.e+-]+) \(([^,]+), bound ([\d.e+-]+)\)", errors)
    nearest = re.search(r"nearest its bound: (.*?)(?:\)|$)", errors)
    return {
        "case": case,
        "exit": proc.returncode,
        "named": first.group(0) if first else ("passes" if "check passed" in verdict else f"no verdict: {out[-400:]!r}"),
        "step 1 gradient": f"{step1.group(1)} ({step1.group(2)}) of {step1.group(3)}" if step1 else "-",
        "nearest": nearest.group(1) if nearest else "-",
        "seconds": round(seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=CASES)
    parser.add_argument("--micro-batch", type=int, default=512, help="rows of 64 tokens per micro-batch (512: 131,072 tokens a step)")
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--work", default=None, help="a directory for the inputs and outputs (default: a temporary one)")
    args = parser.parse_args()
    root = Path(args.work or tempfile.mkdtemp(prefix="check_large_step-"))
    root.mkdir(parents=True, exist_ok=True)
    config = build_inputs(root, args.records, args.micro_batch, 64)
    print(f"step: {args.micro_batch * 2 * 2 * 64:,} tokens; work: {root}", file=sys.stderr)
    print("| case | exit | named (or passes) | step 1 gradient, largest (of its bound) | nearest its bound | s |")
    print("|---|---|---|---|---|---|")
    for case in args.cases:
        r = run_case(case, config, root)
        print(f"| {r['case']} | {r['exit']} | {r['named']} | {r['step 1 gradient']} | {r['nearest']} | {r['seconds']} |", flush=True)


if __name__ == "__main__":
    main()
