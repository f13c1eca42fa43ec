"""Memory metrics come from the rank that peaked highest, not from rank 0 alone."""

from __future__ import annotations

from launching import launch_command, run, tiny_config

from harness.observability.metrics import PEAK_RANK, read_records


def test_each_step_reports_the_worst_ranks_memory(tmp_path):
    cfg = tiny_config(tmp_path / "a.yaml", tmp_path / "cache", tmp_path / "out", steps=2, strategy="fsdp", **{"memory.track": True})
    run(launch_command("torchrun", 2, cfg, []), timeout=300)
    steps = [r for r in read_records(str(tmp_path / "out" / "metrics.jsonl")) if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r[PEAK_RANK] in (0, 1)
        split = sum(
            v
            for k, v in r.items()
            if k.endswith("_peak_bytes") and k != "memory/total_peak_bytes" and not k.startswith(("memory/device_",))
        )
        assert r["memory/total_peak_bytes"] > 0 and split == r["memory/total_peak_bytes"]  # one rank's split, whole
        assert all(
            r[k.replace("_peak_bytes", "_max_bytes")] >= r[k]
            for k in r
            if k.endswith("_peak_bytes") and k != "memory/total_peak_bytes" and k.replace("_peak_bytes", "_max_bytes") in r
        )
