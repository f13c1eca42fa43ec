"""The GPU suite's pre-flight: what every later part needs, checked in one process in ~15 s.

    python benchmarks/gpu_preflight.py [--cpu] [--import MODULE ...]

Imports torch, deepspeed, datasets, transformers, accelerate and the harness's run stack, checks
that CUDA sees a device, takes one tiny bf16 training step on it (forward, backward, AdamW), and
builds a `datasets.Dataset` as the harness does for the embedded corpus, and runs one step of the
harness's own train command on a tiny preset (in this process: the imports are paid once).
Prints one JSON object (versions, device facts, seconds, which `harness.plan` options exist) on
success; on the first failure prints one line, ``pre-flight: <what> failed: <why>``, and exits 1,
so a call whose machine cannot run the suite ends in seconds instead of failing every part.
``--cpu``: the dry run's check on a machine without a GPU (the step runs on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODULES = ["torch", "deepspeed", "datasets", "transformers", "accelerate", "harness.runner", "harness.planner", "harness.plan"]


class Failed(Exception):
    pass


def check(what: str, fn: Any) -> Any:
    try:
        return fn()
    except BaseException as exc:  # an import can raise anything, SystemExit included
        raise Failed(f"pre-flight: {what} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def device_facts(torch: Any, cpu: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if cpu:
        return d
    if not torch.cuda.is_available():
        raise Failed("pre-flight: CUDA visible failed: torch.cuda.is_available() is False")
    p = torch.cuda.get_device_properties(0)
    d.update(
        device=torch.cuda.get_device_name(0),
        capability=f"{p.major}.{p.minor}",
        sms=p.multi_processor_count,
        total_memory=p.total_memory,
        bf16=torch.cuda.is_bf16_supported(),
        cudnn=torch.backends.cudnn.version(),
    )
    with contextlib.suppress(Exception):
        v = torch.cuda.nccl.version()
        d["nccl"] = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    return d


def tiny_step(torch: Any, device: str) -> float:
    """One training step of a two-layer MLP in bf16 autocast: the loss must be finite."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = (model(x).float() - x).pow(2).mean()
    loss.backward()
    opt.step()
    value = float(loss.detach())
    if value != value or value in (float("inf"), float("-inf")):
        raise RuntimeError(f"the loss is {value}")
    return value


def harness_step(cpu: bool) -> float:
    """One step of the harness's own train command, in this process, on a tiny preset and a random token
    file (no tokenizer to train): the harness itself runs on this torch, before any part relies on it."""
    import numpy as np

    import harness.train

    work = Path(tempfile.mkdtemp(prefix="gpu_preflight_"))
    tokens = np.random.default_rng(0).integers(1, 512, 100_000).astype(np.int32)
    tokens[::50] = 0  # documents of 50 tokens, ended by id 0
    np.save(work / "tokens.npy", tokens)
    cfg = {
        "model": {"name": "tiny-llama"},
        "data": {"source": str(work / "tokens.npy"), "eos_id": 0, "seq_len": 32, "vocab_size": 512, "cache_dir": str(work / "cache")},
        "strategy": "ddp",
        "precision": "bf16",
        "micro_batch_size": 2,
        "steps": 1,
        "eval_batches": 1,
        "output_dir": str(work / "run"),
        "logging": {"wandb": False, "progress": False, "plots": False},
        **({"device": "cpu"} if cpu else {}),
    }
    (work / "config.json").write_text(json.dumps(cfg))
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        rc = harness.train.main(["--config", str(work / "config.json")])
    lines = [ln for ln in said.getvalue().splitlines() if ln.strip()]
    if rc != 0:
        why = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "")
        raise RuntimeError(f"exit {rc}: {why.strip()}")
    shutil.rmtree(work, ignore_errors=True)
    return float(rc)


def plan_options() -> list[str]:
    """The options `harness.plan --help` lists (capabilities later parts look for, e.g. --max-seq-len)."""
    import harness.plan

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        harness.plan.main(["--help"])
    return sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="no GPU expected (the dry run)")
    parser.add_argument("--import", dest="extra", action="append", default=[], help="a module to import first (tests)")
    args = parser.parse_args()
    t0 = time.time()
    out: dict[str, Any] = {"python_version": platform.python_version()}
    try:
        for name in [*args.extra, *MODULES]:
            module = check(f"import {name}", lambda n=name: importlib.import_module(n))
            if "." not in name:
                out[name] = getattr(module, "__version__", "?")
        torch = sys.modules["torch"]
        out.update(device_facts(torch, args.cpu))
        out["tiny_step_loss"] = check("one tiny step", lambda: tiny_step(torch, "cpu" if args.cpu else "cuda"))
        # the embedded corpus goes through datasets.Dataset.from_dict (pyarrow underneath) in the harness
        check("datasets.Dataset.from_dict", lambda: sys.modules["datasets"].Dataset.from_dict({"text": ["a", "b"]}))
        check("one harness step (harness.train)", lambda: harness_step(args.cpu))
        out["plan_options"] = check("harness.plan --help", plan_options)
    except Failed as exc:
        print(str(exc)[:300], flush=True)
        return 1
    out["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
