"""The GPU kit's rules, in-process on the simulated clock: a part stops after two identical failures
(and only identical ones), the next part still runs, and every item is in the out folder at once."""

from __future__ import annotations

import json
import time

import pytest
from launching import REPO


@pytest.fixture
def kit(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_parts
    import gpu_runs
    import gpu_suite

    return gpu_suite, gpu_parts, gpu_runs


def sim_ctx(kit, tmp_path, seconds: float = 450):
    suite, parts, runs = kit
    start = time.time()
    clock = runs.Clock(True, start)
    state = runs.State(tmp_path / "state", True, tmp_path / "out", None, clock)
    return parts.Ctx(state, clock, start + seconds, dry=True)


def statuses(ctx, prefix: str) -> dict[str, str]:
    return {k.removeprefix(prefix): v["status"] for k, v in ctx.state.data["items"].items() if k.startswith(prefix)}


def test_two_identical_failures_stop_the_part_and_the_next_part_runs(kit, tmp_path, monkeypatch):
    suite, parts, _ = kit
    monkeypatch.setenv("GPU_SUITE_SIM_FAIL", "strategies/zero1/w1,strategies/zero2/w1")
    ctx = sim_ctx(kit, tmp_path)
    assert suite.run_call(ctx, ["strategies_deepspeed", "throughput_eager"]) == 0
    got = statuses(ctx, "strategies/")
    assert got == {
        "zero1/w1": "failed",
        "zero2/w1": "failed",
        "zero3/w1": "skipped",
        "zero2_offload/w1": "skipped",
        "zero3_offload/w1": "skipped",
    }
    reason = ctx.state.get("strategies/zero3/w1")["reason"]
    assert reason == "part stopped after two identical failures: harness: error: simulated failure"
    assert ctx.state.get("throughput/eager, micro 8")["status"] == "simulated"
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())  # the out folder, not only the state
    assert on_disk["items"]["throughput/eager, micro 8"]["status"] == "simulated"


def test_different_failures_do_not_stop_a_part(kit, tmp_path, monkeypatch):
    _, _, runs = kit
    rule = runs.FailureRule()
    rule.note({"status": "failed", "log_tail": "[  3.10] Traceback ...\n[  3.20] ModuleNotFoundError: No module named 'deepspeed'"})
    rule.note({"status": "failed", "log_tail": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"})
    rule.note({"status": "ok"})
    assert rule.stopped is None
    rule.note({"status": "failed", "log_tail": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.50 GiB"})
    assert rule.stopped == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate N.N GiB"


def test_the_harness_error_line_names_a_failure(kit):
    _, _, runs = kit
    tail = "[ 1.00] harness: error: data.source 'x' is not a local path\n[ 1.10] exit 2"
    assert runs.failure_signature({"status": "failed", "log_tail": tail}) == "harness: error: data.source 'x' is not a local path"
    assert runs.failure_signature({"status": "timeout"}) == "timed out"


def test_an_item_the_call_has_no_time_for_is_left_to_the_next_call(kit, tmp_path):
    suite, _, _ = kit
    ctx = sim_ctx(kit, tmp_path, seconds=60)
    suite.run_call(ctx, ["strategies_torch"])
    got = statuses(ctx, "strategies/")
    assert got == {"ddp/w1": "simulated", "fsdp/w1": "not reached", "fsdp_grad_op/w1": "not reached", "fsdp_offload/w1": "not reached"}
    later = sim_ctx(kit, tmp_path)  # the second call, same state folder
    suite.run_call(later, ["strategies_torch"])
    assert set(statuses(later, "strategies/").values()) == {"simulated"}
    assert later.state.get("strategies/ddp/w1")["call_clock_s"] == ctx.state.get("strategies/ddp/w1")["call_clock_s"]  # not re-run


def test_a_second_call_on_a_cold_machine_starts_where_it_was_told(kit, tmp_path, monkeypatch):
    suite, _, _ = kit
    monkeypatch.setenv("GPU_SUITE_COLD_FROM", "throughput_eager")
    ctx = sim_ctx(kit, tmp_path)  # a new state folder: the first call's state went with the machine
    suite.run_call(ctx, ["strategies_torch", "strategies_deepspeed", "throughput_eager"])
    assert statuses(ctx, "strategies/") == {}
    assert ctx.state.data["parts"]["strategies_torch"]["status"] == "skipped"
    assert ctx.state.get("throughput/eager, micro 8")["status"] == "simulated"
    warm = sim_ctx(kit, tmp_path)  # the same folder again: not new, so nothing is left to another call
    suite.run_call(warm, ["strategies_torch"])
    assert set(statuses(warm, "strategies/").values()) == {"simulated"}


def test_the_long_sequence_rung_reads_the_planner_beside_the_runs(kit, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_long_seq

    plan = {
        "max_seq_len": 8192,
        "step": 4096,
        "probes": [
            {"seq_len": 8192, "fits": True, "device_bytes": 1000},
            {"seq_len": 12288, "fits": False, "device_bytes": 1500},
        ],
    }
    ran = {"status": "ok", "metrics": {"max_allocated_bytes": 900}}
    oom = {"status": "failed", "log_tail": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    item = gpu_long_seq.summarize(plan, {8192: ran, 12288: oom})
    assert (item["planner_max_seq_len"], item["longest_that_ran"], item["first_that_did_not"]) == (8192, 8192, 12288)
    first, second = item["rows"]
    assert first == {
        "seq_len": 8192,
        "outcome": "ran",
        "max_memory_allocated": 900,
        "planner_device_bytes": 1000,
        "planner_fits": True,
        "allocated_over_planner": 0.9,
    }
    assert second["outcome"] == "out of memory" and not second["planner_fits"] and second["allocated_over_planner"] is None
    item["gpu_mem"] = "143771MiB"
    lines = gpu_long_seq.report_lines(item)  # the report's section
    assert lines[0].startswith("Planner (`harness.plan --max-seq-len`, step 4,096, 143771MiB): **8,192** tokens; longest that ran: 8192")
    assert "| 12,288 | over | out of memory | - | 0.0 MiB | - |" in lines
    assert gpu_long_seq.report_lines(None) == ["Not measured: not run"]
    # The planner too cautious: both lengths ran, none failed.
    both = gpu_long_seq.summarize(plan, {8192: ran, 12288: dict(ran)})
    assert (both["longest_that_ran"], both["first_that_did_not"]) == (12288, None)
    # A failure that is not out of memory is named as such and is not read as the limit.
    other = gpu_long_seq.summarize(plan, {8192: ran, 12288: {"status": "timeout"}})
    assert other["rows"][1]["outcome"] == "timeout" and other["first_that_did_not"] is None


def test_the_long_model_is_links_and_a_config_with_more_positions(kit, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_long_seq

    saved = tmp_path / "300m"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps({"max_position_embeddings": 2048, "hidden_size": 8}))
    (saved / "model.safetensors").write_bytes(b"weights")
    long = gpu_long_seq.long_model(str(saved))
    assert json.loads((long / "config.json").read_text()) == {"max_position_embeddings": gpu_long_seq.POSITIONS, "hidden_size": 8}
    assert (long / "model.safetensors").is_symlink() and (long / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((saved / "config.json").read_text())["max_position_embeddings"] == 2048  # the saved model is untouched
    assert gpu_long_seq.long_model(str(saved)) == long  # a second call (the next call on a warm machine) reuses it
