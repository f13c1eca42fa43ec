"""Which buffer makes a real run's peak differ between runs, and which thread frees it.

The planner-accuracy measurement (``harness.planner.measure``) of FSDP2 at world 2 is
exact in most runs and 512 KiB higher in some. This script repeats that measurement with
an instrumented ``MemTracker``: every storage of at least ``--min-bytes`` is tagged with
the op and the Python frames that allocated it, each new peak records which of them are
alive, and each one's death records whether the main thread freed it or another thread
(gloo's worker, dropping its own reference to a finished collective's tensors) did.

The race needs a loaded machine to show; ``--one-core`` pins both ranks to one core,
``--hog`` adds a busy process on that core and ``--starve`` runs every thread but the
main one of each rank at nice 19, so gloo's worker threads run late (that makes it
happen in most steps). Results: notes/planner_accuracy.md.

    python benchmarks/collective_race.py --runs 2 --steps 4 --one-core --hog --starve
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from harness.config import load_config, load_strategy
from harness.distributed import free_port, init_distributed, teardown
from harness.engine import build_engine, hidden_size_of, plan_engine
from harness.models import model_spec
from harness.planner import estimate
from harness.planner.measure import cpu_categories
from harness.training import causal_lm_loss

DEFAULT = [
    "strategy=fsdp_grad_op",
    "model.name=tiny-llama",
    "micro_batch_size=2",
    "data.seq_len=64",
    "precision=fp32",
    "memory.activation_checkpointing=none",
]
VOCAB = 2048
_MAIN = threading.get_ident()
_STATE = threading.local()  # the op being dispatched on this thread, for the allocation tag


def _frames() -> str:
    """The FSDP/harness/optimizer frames of the current stack, innermost first."""
    keep = [
        f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
        for f in traceback.extract_stack(limit=40)[:-3]
        if "/_tools/" not in f.filename and any(k in f.filename for k in ("fsdp", "harness", "optim"))
    ]
    return " < ".join(reversed(keep[-6:]))


class RaceTracker(MemTracker):
    """MemTracker that names large storages, lists them at each new peak and notes where they die."""

    def __init__(self, min_bytes: int) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.step = 0
        self.deaths: list[dict[str, Any]] = []
        self.live_at_peak: list[tuple[int, str]] = []
        self.peak_op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        _STATE.op = str(func)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _tag(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        winfo = self._WINFO.get(st, (None, None))[0]
        if winfo is not None and not hasattr(winfo, "tag") and st.nbytes() >= self.min_bytes:
            modules = sorted(p for p in self._mod_tracker.parents if p != "Global")
            winfo.tag = f"{st.nbytes()} B {getattr(_STATE, 'op', '?')} step {self.step} in {modules[-1] if modules else '-'} [{_frames()}]"

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        super()._track(reftype, t)
        self._tag(t)

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype: Any, update_existing: bool = False) -> Any:
        out = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        self._tag(t)
        return out

    def _delete_callback(self, winfo: Any, w_st: Any) -> None:
        if winfo.mem_consumed >= self.min_bytes:
            self.deaths.append({"tag": getattr(winfo, "tag", "untagged"), "main_thread": threading.get_ident() == _MAIN})
        super()._delete_callback(winfo, w_st)

    def _update_peak_stats(self, peak_state: Any) -> None:
        cpu = torch.device("cpu")
        before = self._peak_mem.get(cpu, 0)
        super()._update_peak_stats(peak_state)
        if self._peak_mem.get(cpu, 0) > before:
            self.live_at_peak = sorted(
                (
                    (w.mem_consumed, getattr(w, "tag", "untagged"))
                    for w, _ in list(self._WINFO.values())
                    if w.mem_consumed >= self.min_bytes
                ),
                reverse=True,
            )
            self.peak_op = getattr(_STATE, "op", "?")


def _starve_other_threads() -> None:
    """Every thread of this process but the main one (gloo's workers among them) to nice 19."""
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)


def worker(overrides: list[str], steps: int, min_bytes: int, starve: bool, out: str) -> None:
    """One rank under torchrun: build the engine inside the tracker, then measure ``steps`` steps."""
    cfg = load_config(None, overrides)
    strategy = load_strategy(cfg.strategy)
    info = init_distributed("cpu", force_group=strategy.needs_process_group)
    gen = torch.Generator().manual_seed(1000 + info.rank)
    tracker = RaceTracker(min_bytes)
    with tracker:
        spec = model_spec(cfg.model.name, vocab_size=VOCAB, seed=cfg.model.seed)
        plan = plan_engine(cfg, strategy, info.world_size, info.device, hidden_size_of(spec.config))
        engine = build_engine(spec, cfg, plan, info, lambda m, ids: causal_lm_loss(m, ids, chunk_size=cfg.memory.loss_chunk_size))
        batch = torch.randint(0, VOCAB, (cfg.micro_batch_size, cfg.data.seq_len), generator=gen)
    if starve:  # after the engine: FSDP2's device mesh may have started process groups of its own
        _starve_other_threads()
    results = []
    for step in range(steps):
        tracker.step, tracker.deaths = step, []
        tracker.reset_mod_stats()
        with tracker:
            loss = engine.forward_loss(batch)
            engine.backward(loss, last_micro=True)
            del loss
            engine.step()
        results.append(
            {
                "step": step,
                "peak": cpu_categories(tracker.get_tracker_snapshot("peak"))["total"],
                "peak_op": tracker.peak_op,
                "live": tracker.live_at_peak,
                "deaths": tracker.deaths,
            }
        )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": info.rank, "steps": results})
    teardown()
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    sys.stdout.flush()
    os._exit(0)  # as harness.planner.measure: gloo's threads may abort in static destructors


def _launch(overrides: list[str], steps: int, min_bytes: int, starve: bool, one_core: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        out = os.path.join(tmp, "out.json")
        cmd = (["taskset", "-c", "0"] if one_core else []) + [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            os.path.abspath(__file__),
            "--worker",
            "--out",
            out,
            "--steps",
            str(steps),
            "--min-bytes",
            str(min_bytes),
            *(["--starve"] if starve else []),
            *overrides,
        ]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=900)
        if proc.returncode or not os.path.exists(out):
            raise RuntimeError(f"run failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help=f"config overrides (default: {' '.join(DEFAULT)})")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--min-bytes", type=int, default=256 * 1024, help="storages tagged and reported")
    parser.add_argument("--one-core", action="store_true", help="both ranks on CPU 0 (taskset)")
    parser.add_argument("--hog", action="store_true", help="a busy process on CPU 0 meanwhile")
    parser.add_argument("--starve", action="store_true", help="all threads but the main one at nice 19")
    parser.add_argument("--worker", action="store_true", help="internal: one rank under torchrun")
    parser.add_argument("--out", help="internal: the rank-0 result file")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    overrides = args.overrides or DEFAULT
    if args.worker:
        worker(overrides, args.steps, args.min_bytes, args.starve, args.out)
        return 0
    plan = estimate(load_config(None, overrides), 2, target="cpu", vocab_size=VOCAB)
    print(
        f"plan: {plan.total:,} B, race_bytes {plan.race_bytes:,}: a run peaks in [{plan.total - plan.race_bytes:,}, {plan.total:,}]",
        flush=True,
    )
    hog = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"]) if args.hog else None
    try:
        for run in range(args.runs):
            for rank in _launch(overrides, args.steps, args.min_bytes, args.starve, args.one_core):
                for st in rank["steps"]:
                    off_main = [d["tag"] for d in st["deaths"] if not d["main_thread"]]
                    print(
                        f"run {run} rank {rank['rank']} step {st['step']}: peak {st['peak']:,} at {st['peak_op']}; "
                        f"{len(off_main)} freed off the main thread",
                        flush=True,
                    )
                    for tag in off_main:
                        print(f"    freed off main: {tag}", flush=True)
                    for nbytes, tag in st["live"]:
                        print(f"    live at peak {nbytes:,}: {tag}", flush=True)
    finally:
        if hog is not None:
            hog.terminate()
            hog.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
