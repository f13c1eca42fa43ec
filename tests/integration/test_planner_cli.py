"""`python -m harness.plan`: reports, recommendations that launch, and one-line errors with exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launching import REPO as _REPO

from harness.config import load_config
from harness.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_PLAN_DOES_NOT_FIT, EXIT_PLAN_NOTHING_FITS
from harness.plan import main
from harness.planner import estimate, parse_size, verdict

REPO = str(_REPO)
TINY = ["model.name=tiny-llama", "micro_batch_size=2", "data.seq_len=64"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("harness.plan: error: ")
    return lines[0]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--gpu-mem", "48XB"], "unknown memory size '48XB'"),
        (["--gpus", "0", "--gpu-mem", "48GiB"], "--gpus must be >= 1"),
        (["--gpu-mem", "48GiB", "model.name=/nonexistent/model"], "cannot build model '/nonexistent/model'"),
        (["--gpu-mem", "48GiB", "strategy=zero9"], "strategy 'zero9'"),
        (["--gpu-mem", "48GiB", "--max-seq-len", "--recommend"], "drop --recommend"),
        (["--gpu-mem", "48GiB", "--max-seq-len", "--seq-step", "0"], "--seq-step must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == EXIT_BAD_INPUT
    assert needle in _one_line_error(capsys)


def test_nothing_fits_is_one_line_and_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    # 1 MiB: the tiny model's own states (5.4 MiB in fp32) cannot fit under any strategy.
    assert main(["--gpu-mem", "1MiB", *TINY]) == EXIT_PLAN_NOTHING_FITS
    assert "nothing fits" in _one_line_error(capsys)


def test_plan_reports_a_fit_and_writes_json(tmp_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = os.path.join(tmp_path, "plan.json")
    argv = ["--gpus", "2", "--gpu-mem", "48GiB", "--json", out, "--vocab-size", "2048", "strategy=zero2", *TINY]
    assert main(argv) == EXIT_OK
    text = capsys.readouterr().out
    for heading in ("Per-rank peak", "Allowance for what a CPU trace cannot see", "Host (CPU) memory", "Model states of all", "FITS"):
        assert heading in text
    with open(out) as f:
        report = json.load(f)
    cfg = load_config(None, ["strategy=zero2", *TINY])
    est = estimate(cfg, 2, vocab_size=2048)
    assert report["peak_bytes"] == est.total
    assert sum(report["peak_by_category"].values()) == report["peak_bytes"]
    assert report["device_need_bytes"] == report["peak_bytes"] + report["allowance_bytes"]["total"]


def test_plan_that_does_not_fit_exits_1_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, ["strategy=ddp", *TINY])
    need = verdict(estimate(cfg, 2, vocab_size=2048), 10**15, None, 2).device_need
    budget = f"{need - 1}"  # one byte short for DDP, plenty for sharding the tiny model's states
    assert main(["--gpus", "2", "--gpu-mem", budget, "--vocab-size", "2048", "strategy=ddp", *TINY]) == EXIT_PLAN_DOES_NOT_FIT
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "--recommend" in out


def test_recommend_writes_a_config_that_loads_and_fits(tmp_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = os.path.join(tmp_path, "run.yaml")
    with open(config, "w") as f:
        f.write("model:\n  name: tiny-llama\ndata:\n  seq_len: 64\nmicro_batch_size: 4\nstrategy: ddp\nsteps: 7\n")
    base = load_config(config)
    ddp_need = verdict(estimate(base, 2, vocab_size=2048), 10**15, None, 2).device_need
    out = os.path.join(tmp_path, "best.yaml")
    argv = ["--config", config, "--gpus", "2", "--gpu-mem", str(ddp_need - 1), "--vocab-size", "2048", "--recommend", "--out", out]
    assert main(argv) == EXIT_OK
    text = capsys.readouterr().out
    assert "Best:" in text and "why:" in text and "Memory ladder" in text and "-> bf16 mixed precision" in text
    best = load_config(out)  # launchable as written
    assert best.steps == 7 and best.model.name == "tiny-llama"  # the user's other settings survive
    assert best.micro_batch_size * best.grad_accum >= base.micro_batch_size * base.grad_accum
    fitted = estimate(best, 2, vocab_size=2048)
    assert verdict(fitted, ddp_need - 1, None, 2).fits


def test_recommend_fastest_searches_by_speed_and_writes_a_config_that_fits(tmp_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = os.path.join(tmp_path, "run.yaml")
    with open(config, "w") as f:
        f.write("model:\n  name: tiny-llama\ndata:\n  seq_len: 64\nmicro_batch_size: 4\nstrategy: ddp\nsteps: 7\n")
    ddp_need = verdict(estimate(load_config(config), 2, vocab_size=2048), 10**15, None, 2).device_need
    out = os.path.join(tmp_path, "fast.yaml")
    argv = [
        "--config",
        config,
        "--gpus",
        "2",
        "--gpu-mem",
        str(ddp_need - 1),
        "--vocab-size",
        "2048",
        "--recommend",
        "--fastest",
        "--out",
        out,
    ]
    assert main(argv) == EXIT_OK
    text = capsys.readouterr().out
    assert "fastest first" in text and "Best:" in text and "Memory ladder" not in text
    best = load_config(out)
    assert best.steps == 7 and verdict(estimate(best, 2, vocab_size=2048), ddp_need - 1, None, 2).fits
    assert main(["--gpu-mem", "8GiB", "--vocab-size", "2048", "--fastest", *TINY]) == EXIT_BAD_INPUT  # without --recommend


def test_max_seq_len_answers_the_longest_length_that_fits(tmp_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The answer fits and one step more does not, by the planner's own estimate and verdict (a CPU run: fast traces);
    memory, not tiny-llama's 512 positions (the search's cap), ends it."""
    out = os.path.join(tmp_path, "seq.json")
    base = ["model.name=tiny-llama", "micro_batch_size=1", "memory.activation_checkpointing=full", "memory.tiled_mlp=4"]
    argv = ["--gpu-mem", "12MiB", "--target", "cpu", "--vocab-size", "2048", "--max-seq-len", "--seq-step", "128", "--json", out, *base]
    assert main(argv) == EXIT_OK
    assert "Longest seq_len that fits" in capsys.readouterr().out
    with open(out) as f:
        answer = json.load(f)["max_seq_len"]
    assert answer > 128 and answer % 128 == 0

    def fits(seq: int) -> bool:
        est = estimate(load_config(None, [*base, f"data.seq_len={seq}"]), 1, target="cpu", vocab_size=2048)
        return verdict(est, parse_size("12MiB"), None, 1).fits

    assert fits(answer) and not fits(answer + 128)


def test_module_entry_point_runs() -> None:
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "harness.plan", "--gpu-mem", "8GiB", "--vocab-size", "2048", *TINY],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "Per-rank peak" in proc.stdout and parse_size("8GiB") > 0
