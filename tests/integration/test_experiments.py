"""`python -m harness.experiments`, the README's technique-matrix command, through its entry point
on a two-row matrix of tiny runs (3 steps each, one process: tens of seconds on a loaded 2-core
machine): the table it prints and writes holds both rows, in the matrix's order, with the numbers
of each row's own metrics, and `--resume` reuses finished rows without training again."""

from __future__ import annotations

import json
import math
import statistics
import sys

import yaml
from launching import REPO, run, tiny_config

from harness.experiments import WARMUP_STEPS
from harness.observability.metrics import read_records


def test_a_two_row_matrix_runs_and_tabulates_each_row(tmp_path, data_cache):
    base = yaml.safe_load(tiny_config(tmp_path / "base.yaml", data_cache, tmp_path / "unused", **{"memory.track": True}).read_text())
    base.pop("output_dir")  # each row gets its own
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(
        yaml.safe_dump(
            {
                "title": "two rows",
                "base": base,
                "control": "plain",
                "runs": [{"name": "plain"}, {"name": "full AC", "overrides": {"memory": {"activation_checkpointing": "full"}}}],
            }
        )
    )
    out = tmp_path / "out"
    command = [sys.executable, "-m", "harness.experiments", str(matrix), "--out", str(out)]
    done = run(command, timeout=300)
    assert "[1/2] plain ..." in done.stdout and "[2/2] full AC ..." in done.stdout
    assert "# two rows" in done.stdout and (out / "results.md").read_text() in done.stdout

    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results] == ["plain", "full AC"]
    for row, folder in zip(results, ["plain", "full_AC"]):
        config = yaml.safe_load((out / folder / "config.yaml").read_text())
        assert config["output_dir"] == str(out / folder / "run")
        train = [r for r in read_records(str(out / folder / "run" / "metrics.jsonl")) if "train/loss" in r]
        assert [r["step"] for r in train] == [1, 2, 3]
        assert row["step_time_s"] == statistics.median(r["perf/step_time_s"] for r in train[WARMUP_STEPS:])
        assert row["final_loss"] == train[-1]["train/loss"] and math.isfinite(row["final_loss"])
        assert row["tracked_total_bytes"] == max(r.get("memory/total_peak_bytes") or 0 for r in train) > 0
        assert row["peak_source"] == "MemTracker" and row["eval_perplexity"] > 1
    assert results[1]["overrides"] == {"memory": {"activation_checkpointing": "full"}}
    assert yaml.safe_load((out / "full_AC" / "config.yaml").read_text())["memory"]["activation_checkpointing"] == "full"
    table = (out / "results.md").read_text().splitlines()
    plain_row = next(line for line in table if line.startswith("| plain | 1 |"))
    assert "| +0.0% |" in plain_row  # the control against itself
    reduction = 1 - results[1]["peak_bytes"] / results[0]["peak_bytes"]
    assert any(line.startswith("| full AC | 1 |") and f"| {reduction:+.1%} |" in line for line in table)
    assert (out / "peak_memory_by_category.png").stat().st_size > 0 and (out / "samples_per_s.png").stat().st_size > 0

    again = run(command + ["--resume"], timeout=300)
    assert "[1/2] plain: reusing the finished run" in again.stdout and "[2/2] full AC: reusing the finished run" in again.stdout
    assert json.loads((out / "results.json").read_text()) == results


def test_a_matrix_without_runs_is_refused_in_one_line(tmp_path):
    matrix = tmp_path / "empty.yaml"
    matrix.write_text(yaml.safe_dump({"base": {}, "runs": []}))
    done = run([sys.executable, "-m", "harness.experiments", str(matrix)], timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert errors == [f"harness.experiments: error: {matrix}: no runs"], done.stderr[-2000:]
    assert not (REPO / "runs" / "experiments" / "empty").exists()
