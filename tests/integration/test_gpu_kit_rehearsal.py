"""The GPU kit rehearsed on CPU, so it cannot rot between GPU sessions.

The two device-tool calls notes/gpu_plan.md prescribes are read from the note and run exactly as
written, with `--dry-run --sim-clock` appended: nothing is trained, each run spends its GPU
estimate on a simulated clock, the pre-flight imports for real. What this proves: the commands
parse, the parts run in the value order the plan promises and within each call's deadline, the
second call goes on where the first stopped, and the out folder holds the report of every item.
What it does not prove: that the estimates hold on a GPU (the first GPU call's wall times will say).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from launching import REPO

pytestmark = pytest.mark.integration

PLAN = REPO / "notes" / "gpu_plan.md"
CALL = re.compile(r'^run\(command="(?P<command>[^"]+)", carry=(?P<carry>\[[^\]]*\]), timeout_s=(?P<timeout>\d+)\)$', re.M)
STRATEGIES = ["ddp", "fsdp", "fsdp_grad_op", "fsdp_offload", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]
EAGER_ROWS = ["control fp32", "bf16", "AC", "bf16 + OIB + AC", "OIB + AC", "best (bf16 + OIB + AC + chunked loss)", "optimizer-in-backward"]
# The order: what a cut call must already have returned.
VALUE_ORDER = [
    "preflight",
    "facts",
    *[f"strategies/{s}/w1" for s in STRATEGIES],
    "throughput/eager, micro 8",
    "long_seq/at_plan",  # the planner's longest sequence, then one step past it, then the rung's item
    "long_seq/past_plan",
    "long_seq",
    *[f"matrix/{r}" for r in EAGER_ROWS],
    "throughput/compile=block, micro 8",
]
DONE = ("ok", "simulated")


def rehearse(command: str, out, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict]:
    command = command.replace("$OUT", str(out)) + " --dry-run --sim-clock"
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    return proc, results


def rehearsal_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SUITE_")}  # the plan's defaults, not a developer's knobs
    return dict(env, GPU_SUITE_STATE=str(tmp_path / "state"), PY=sys.executable, PYTHONPATH=str(REPO))


def test_the_two_planned_calls_run_in_value_order_within_their_deadlines(tmp_path):
    calls = [m.groupdict() for m in CALL.finditer(PLAN.read_text())]
    assert len(calls) == 2, f"{PLAN.name} must prescribe exactly two run(...) calls, found {len(calls)}"
    env = rehearsal_env(tmp_path)
    snapshots = []
    for i, call in enumerate(calls):
        call_s = int(re.search(r"GPU_SUITE_CALL_S=(\d+)", call["command"]).group(1))
        assert call_s + 15 <= int(call["timeout"]) <= 600, call  # the suite ends itself before the tool would
        assert json.loads(call["carry"]) == ["wheels"]
        out = tmp_path / f"out{i}"
        proc, results = rehearse(call["command"], out, env)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        reports = list(out.glob("*.md"))  # the report, rewritten at every item like results.json
        assert len(reports) == 1 and (out / "logs.tar.gz").exists(), sorted(p.name for p in out.iterdir())
        assert "REHEARSAL" in reports[0].read_text()
        last = results["meta"]["calls"][-1]
        assert last["simulated_clock"] and last["used_s"] <= call_s - 20, last  # the tarball's 20 s stay free
        snapshots.append({k: v["status"] for k, v in results["items"].items()})
    first, final = snapshots
    items = results["items"]
    assert items["preflight"]["status"] == "ok" and items["preflight"]["torch"]  # imported for real
    assert not [k for k in items if k.startswith("matrix/") and k.removeprefix("matrix/") not in EAGER_ROWS], "compiled rows are opt-in"
    # What ran, in the order it ran (call, then simulated clock), is a prefix of the value order; the rest was not reached.
    # (A rung's item is recorded at the instant of its last run: such ties are read in the value order.)
    rank = {k: i for i, k in enumerate(VALUE_ORDER)}
    when = sorted(items, key=lambda k: (items[k]["call"], items[k]["call_clock_s"], rank.get(k, -1)))
    ran = [k for k in when if items[k]["status"] in DONE]
    assert ran == VALUE_ORDER[: len(ran)], ran
    assert all(final.get(k) == "not reached" for k in VALUE_ORDER[len(ran) :]), final
    # The budget's promise: the strategies in the first call, the MFU run by the end of the second.
    assert all(first[f"strategies/{s}/w1"] in DONE for s in STRATEGIES), first
    assert "throughput/eager, micro 8" in ran
    # The second call went on where the first stopped: nothing the first call finished ran again.
    assert {k: v for k, v in first.items() if v in DONE} == {k: v for k, v in final.items() if v in DONE and first.get(k) in DONE}
    rung = items["long_seq"]  # a rehearsal asks no planner: the simulated answer is one step
    assert rung["status"] == "simulated" and [r["seq_len"] for r in rung["rows"]] == [4096, 8192], rung


def test_a_failed_preflight_ends_the_call_in_one_line(tmp_path):
    env = dict(rehearsal_env(tmp_path), GPU_SUITE_PREFLIGHT_IMPORT="harness_kit_no_such_module")
    proc, results = rehearse("GPU_SUITE_CALL_S=450 bash benchmarks/gpu_suite.sh $OUT", tmp_path / "out", env)
    assert proc.returncode == 3, proc.stdout[-3000:]
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("gpu_suite: pre-flight")]
    assert said == [
        "gpu_suite: pre-flight: import harness_kit_no_such_module failed: ModuleNotFoundError: "
        "No module named 'harness_kit_no_such_module'; the call stops here"
    ]
    assert set(results["items"]) == {"preflight"} and results["items"]["preflight"]["status"] == "failed"
