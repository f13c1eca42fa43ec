"""Observability: W&B offline files, the JSONL file, plots, rank-0-only output, W&B modes,
the non-terminal progress fallback and the MFU arithmetic.

W&B results are read back from the run's `.wandb` transaction log with wandb's own reader
(`wandb leet inspect --json`), never assumed from what we passed in.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import random
import socket
import subprocess
import sys
import time

import pytest
import torch

from harness.config import LoggingConfig, RunConfig, config_to_dict
from harness.observability import Observer, mfu
from harness.observability import metrics as M
from harness.observability.progress import Progress
from harness.observability.wandb_logger import has_api_key, resolve_mode

pytestmark = pytest.mark.usefixtures("isolated_wandb")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _step_metrics(rng: random.Random, world: int) -> dict[str, float]:
    m = {
        M.TRAIN_LOSS: rng.uniform(2.0, 8.0),
        M.TRAIN_LR: rng.uniform(1e-4, 1e-3),
        M.TRAIN_GRAD_NORM: rng.uniform(0.1, 3.0),
        M.TRAIN_SKIPPED: rng.randrange(3),
        M.TOKENS_PER_S: rng.uniform(1e3, 1e4),
        M.SAMPLES_PER_S: rng.uniform(1.0, 50.0),
        M.MAX_ALLOCATED: rng.randrange(1 << 20, 1 << 30),
        M.TRAIN_AUX_LOSS: rng.uniform(1.9, 2.5),  # a mixture-of-experts run's router loss and expert load
        **{f"{M.EXPERT_LOAD_PREFIX}{layer}": rng.uniform(1.0, 2.0) for layer in (0, 1, 10)},
    }
    m.update({M.memory_key(c): rng.randrange(1 << 10, 1 << 28) for c in M.MEMORY_CATEGORIES})
    return m


def _logging(**kw) -> LoggingConfig:
    kw.setdefault("progress", False)
    return LoggingConfig(**kw)


def _jsonl(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _wandb_records(run_dir, summary: bool = False):
    files = glob.glob(os.path.join(str(run_dir), "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json"] + (["--summary"] if summary else []) + [files[0]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out) if summary else [json.loads(line) for line in out.splitlines() if line.strip()]


# ------------------------------------------------------------------------- W&B offline


def test_offline_wandb_files_hold_the_logged_metrics(tmp_path):
    rng = random.Random(7)
    cfg = RunConfig()
    world, steps, peak = 2, 4, rng.uniform(1e12, 1e14)
    flops = rng.uniform(1e6, 1e9)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    obs = Observer(str(run_dir), config_to_dict(cfg), _logging(peak_flops=peak), 0, world, steps, flops_per_token=flops, stream=out)
    assert obs.wandb_mode == "offline"  # no API key anywhere
    logged, reserved = {}, {}
    buffers = M.memory_key("model_buffers")  # a category beyond the six: still a max summary
    for step in range(1, steps + 1):
        logged[step] = {**_step_metrics(rng, world), buffers: rng.randrange(1 << 10, 1 << 20)}
        reserved[step] = rng.randrange(1 << 30, 1 << 31)
        # memory_tracking's names for the allocator peaks, and a category not measured this step.
        obs.log_step(step, {**logged[step], "memory/device_reserved_peak_bytes": reserved[step], M.memory_key("other"): None})
    eval_loss = rng.uniform(2.0, 6.0)
    obs.log_eval(steps, {"loss": eval_loss})
    layers = {f"model.layers.{i}.mlp.up_proj": rng.uniform(0.3, 0.7) for i in range(3)}
    achieved = sum(layers.values()) / len(layers)
    # The shape of harness.pruning's PruneReport.to_dict().
    obs.log_prune(
        {
            "method": "wanda",
            "achieved_sparsity": achieved,
            "peak_device_bytes": None,
            "layers": [{"name": k, "numel": 64, "pruned": 32, "sparsity": v} for k, v in layers.items()],
        }
    )
    summary = obs.close()

    records = _wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    train_rows = {row[M.STEP]: row for row in history if M.TRAIN_LOSS in row}
    assert sorted(train_rows) == list(range(1, steps + 1))
    for step, sent in logged.items():
        row = train_rows[step]
        for key, value in sent.items():
            assert row[key] == pytest.approx(value, rel=1e-12), key
        assert row[M.TOKENS_PER_S_DEVICE] == pytest.approx(sent[M.TOKENS_PER_S] / world)
        assert row[M.SAMPLES_PER_S_DEVICE] == pytest.approx(sent[M.SAMPLES_PER_S] / world)
        assert row[M.MFU] == pytest.approx(sent[M.TOKENS_PER_S] / world * flops / peak)
        assert row[M.MAX_RESERVED] == reserved[step] and M.memory_key("other") not in row
    eval_row = next(row for row in history if M.EVAL_LOSS in row)
    assert eval_row[M.STEP] == steps
    assert eval_row[M.EVAL_LOSS] == pytest.approx(eval_loss)
    assert eval_row[M.EVAL_PERPLEXITY] == pytest.approx(math.exp(eval_loss))
    prune_row = next(row for row in history if M.PRUNE_ACHIEVED in row)
    assert prune_row[M.PRUNE_ACHIEVED] == pytest.approx(achieved)
    for layer, value in layers.items():
        assert prune_row[M.PRUNE_LAYER_PREFIX + layer] == pytest.approx(value)
    assert not any(k.startswith("prune/layers") for row in history for k in row)
    assert any(k.startswith("plots/memory") for row in history for k in row)

    # The run config, and the dashboard's x-axis and summaries, as wandb recorded them.
    run = next(r["run"] for r in records if r["type"] == "run")
    config = run["config"]["update"]
    assert config["optim"]["lr"] == cfg.optim.lr and config["steps"] == cfg.steps
    metric_defs = [r["metric"] for r in records if r["type"] == "metric"]
    assert {"glob_name": "*", "step_metric": M.STEP} in [{k: d[k] for k in ("glob_name", "step_metric") if k in d} for d in metric_defs]
    state = _wandb_records(run_dir, summary=True)
    assert state["state"] == "finished"
    assert state["config"]["run_info"]["world_size"] == world
    for key in [M.memory_key(c) for c in M.MEMORY_CATEGORIES] + [buffers, M.MAX_ALLOCATED]:
        assert state["summary"][key]["max"] == max(v[key] for v in logged.values())
    assert state["summary"][M.MAX_RESERVED]["max"] == max(reserved.values())
    assert state["summary"][M.TRAIN_LOSS]["min"] == pytest.approx(min(v[M.TRAIN_LOSS] for v in logged.values()))
    assert summary["wandb_dir"] == glob.glob(os.path.join(str(run_dir), "wandb", "offline-run-*"))[0]

    # The JSONL file says the same.
    events = _jsonl(run_dir)
    assert [e["kind"] for e in events] == ["start"] + ["train"] * steps + ["eval", "prune", "summary"]
    for event in (e for e in events if e["kind"] == "train"):
        for key, value in logged[event["step"]].items():
            assert event[key] == pytest.approx(value, rel=1e-12)
    assert "Run summary" in out.getvalue()


def test_wandb_mode_disabled_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    obs = Observer(str(run_dir), {}, _logging(plots=False), 0, 1, 2, stream=io.StringIO())
    obs.log_step(1, {"loss": 1.5})
    obs.log_step(2, {"loss": 1.25})
    summary = obs.close()
    assert summary["wandb_mode"] == "disabled" and obs.wandb_mode == "disabled"
    assert not (run_dir / "wandb").exists()
    assert [e.get(M.TRAIN_LOSS) for e in _jsonl(run_dir) if e["kind"] == "train"] == [1.5, 1.25]


def test_a_wandb_error_stops_wandb_not_the_run(tmp_path, capfd):
    run_dir = tmp_path / "run"
    obs = Observer(str(run_dir), {}, _logging(plots=False), 0, 1, 3, stream=io.StringIO())
    assert obs.wandb_mode == "offline"

    def broken_log(*args, **kwargs):
        raise ConnectionError("service gone")

    obs.wandb.run.log = broken_log
    for step in (1, 2, 3):
        obs.log_step(step, {"loss": float(step)})
    summary = obs.close()
    assert summary["wandb_mode"] == "disabled"
    assert "W&B logging stops, the run goes on" in capfd.readouterr().err
    assert [e[M.TRAIN_LOSS] for e in _jsonl(run_dir) if e["kind"] == "train"] == [1.0, 2.0, 3.0]


def test_resolve_mode_follows_wandb_conventions(tmp_path):
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    port = refused.getsockname()[1]
    refused.close()  # nothing listens there: connection refused at once
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1\n  login user\n  password {'k' * 40}\n")
    base = {"NETRC": str(tmp_path / "absent"), "WANDB_BASE_URL": f"http://127.0.0.1:{port}"}
    assert resolve_mode(False, base)[0] == "disabled"
    assert resolve_mode(True, base)[0] == "offline"
    assert resolve_mode(True, {**base, "WANDB_DISABLED": "true"})[0] == "disabled"
    assert resolve_mode(True, {**base, "WANDB_MODE": "dryrun"})[0] == "offline"
    assert resolve_mode(True, {**base, "WANDB_MODE": "online"})[0] == "online"
    assert not has_api_key(base)
    assert has_api_key({**base, "NETRC": str(netrc)})
    mode, why = resolve_mode(True, {**base, "NETRC": str(netrc)})
    assert mode == "offline" and "unreachable" in why


def test_unreachable_server_with_a_key_logs_offline_without_waiting(tmp_path, monkeypatch):
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    port = refused.getsockname()[1]
    refused.close()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    obs = Observer(str(tmp_path / "run"), {}, _logging(plots=False), 0, 1, 1, stream=io.StringIO())
    obs.log_step(1, {"loss": 2.0})
    summary = obs.close()
    assert summary["wandb_mode"] == "offline"
    assert time.monotonic() - start < 30.0  # W&B's own default would wait 90 s in init alone
    assert glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))


# ------------------------------------------------------------------------- JSONL and plots


def test_jsonl_folds_the_steps_between_logged_steps(tmp_path):
    rng = random.Random(3)
    steps, every = 7, 3
    obs = Observer(str(tmp_path), {}, _logging(wandb=False, plots=False, log_every=every), 0, 1, steps)
    sent = {s: _step_metrics(rng, 1) for s in range(1, steps + 1)}
    sent[2][M.TRAIN_LOSS] = float("nan")  # a skipped, non-finite step
    for s in range(1, steps + 1):
        obs.log_step(s, dict(sent[s]))
    obs.close()
    train = [e for e in _jsonl(tmp_path) if e["kind"] == "train"]
    assert [e["step"] for e in train] == [3, 6, 7]
    for event, interval in zip(train, ([1, 2, 3], [4, 5, 6], [7])):
        window = [sent[s] for s in interval]
        for c in M.MEMORY_CATEGORIES:
            assert event[M.memory_key(c)] == max(w[M.memory_key(c)] for w in window)
        assert event[M.TRAIN_LR] == window[-1][M.TRAIN_LR]
        assert event[M.TOKENS_PER_S] == pytest.approx(sum(w[M.TOKENS_PER_S] for w in window) / len(window))
        losses = [w[M.TRAIN_LOSS] for w in window]
        if all(math.isfinite(x) for x in losses):
            assert event[M.TRAIN_LOSS] == pytest.approx(sum(losses) / len(losses))
        else:
            assert event[M.TRAIN_LOSS] is None  # NaN is not JSON: written as null


def test_memory_categories_are_the_stackable_ones():
    keys = [M.memory_key(c) for c in ("other", "activations", "parameters", "model_buffers")]
    keys += [M.MEMORY_TOTAL, M.MAX_ALLOCATED, "memory/device_allocated_peak_bytes", M.TRAIN_LOSS]
    assert M.memory_categories(keys) == ["parameters", "activations", "model_buffers", "other"]


def test_plots_are_valid_pngs_and_summary_matches(tmp_path):
    from matplotlib.image import imread

    rng = random.Random(11)
    out = io.StringIO()
    obs = Observer(str(tmp_path), {}, _logging(wandb=False), 0, 2, 6, stream=out)
    sent = {}
    for s in range(1, 7):
        sent[s] = _step_metrics(rng, 2)
        obs.log_step(s, dict(sent[s]))
        if s % 3 == 0:
            obs.log_eval(s, {"loss": rng.uniform(2, 5)})
    layers = {f"layers.{i}.q_proj": rng.uniform(0.3, 0.7) for i in range(2)}
    obs.log_prune({"sparsity": layers, "achieved_sparsity": 0.5}, step=6)
    obs.log_summary({"note": "hello"})
    summary = obs.close()
    prune = next(e for e in _jsonl(tmp_path) if e["kind"] == "prune")
    assert prune["step"] == 6 and prune[M.PRUNE_ACHIEVED] == 0.5
    assert {k[len(M.PRUNE_LAYER_PREFIX) :]: v for k, v in prune.items() if k.startswith(M.PRUNE_LAYER_PREFIX)} == layers
    assert set(summary["plots"]) == {"loss", "memory", "throughput", "moe"}
    for name in ("loss", "memory", "throughput", "moe"):
        path = tmp_path / f"{name}.png"
        assert summary["plots"][name] == str(path)
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = imread(str(path))
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert len({tuple(px) for px in image.reshape(-1, image.shape[2])[::97]}) > 5  # not blank
    for c in M.MEMORY_CATEGORIES:
        assert summary[M.memory_key(c)] == max(v[M.memory_key(c)] for v in sent.values())
    evals = [e for e in _jsonl(tmp_path) if e["kind"] == "eval"]
    assert summary["eval/perplexity_best"] == pytest.approx(min(math.exp(e[M.EVAL_LOSS]) for e in evals))
    steady = [sent[s][M.TOKENS_PER_S] for s in range(2, 7)]
    assert summary["perf/tokens_per_s_mean"] == pytest.approx(sum(steady) / len(steady))
    assert summary["note"] == "hello"
    assert summary["train/aux_loss_final"] == sent[6][M.TRAIN_AUX_LOSS]
    loads = {layer: sent[6][f"{M.EXPERT_LOAD_PREFIX}{layer}"] for layer in (0, 1, 10)}
    worst = max(loads, key=loads.__getitem__)
    assert (summary["moe/expert_load_worst"], summary["moe/expert_load_worst_layer"]) == (loads[worst], worst)
    assert summary["moe/expert_load_mean"] == pytest.approx(sum(loads.values()) / 3)
    printed = out.getvalue()
    assert "Run summary" in printed and "eval/perplexity_best" in printed and "| note" in printed
    assert "| moe/expert_load_worst " in printed and "| train/aux_loss_final " in printed


# ------------------------------------------------------------------------- rank 0 only


# ------------------------------------------------------------------------- progress


def test_progress_without_a_terminal_prints_plain_lines():
    out = io.StringIO()  # isatty() is False, like a CI or SLURM log
    progress = Progress(10, every=5, stream=out)
    assert not progress.bar_mode
    for step in range(1, 11):
        progress.update(step, loss=10.0 / step, memory_bytes=3 * 2**30, aux_loss=2.0 + step / 100, expert_load=1.25)
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(" | ")[0] for line in lines] == ["step 5/10 (50%)", "step 10/10 (100%)"]
    for line, step in zip(lines, (5, 10)):
        assert f"loss {10.0 / step:.4f}" in line and "mem 3.00 GiB" in line and "ETA" in line and "step/s" in line
        assert f"aux {2.0 + step / 100:.4g} | load 1.25" in line


def test_progress_on_a_terminal_draws_a_bar():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    progress = Progress(4, stream=out)
    assert progress.bar_mode
    for step in range(1, 5):
        progress.update(step, loss=1.0)
    progress.close()
    assert "\r" in out.getvalue() and "4/4" in out.getvalue()


# ------------------------------------------------------------------------- MFU


def test_matmul_params_counts_every_non_embedding_weight():
    from transformers import AutoModelForCausalLM

    from harness.models import preset_config

    config = preset_config("tiny-llama")
    model = AutoModelForCausalLM.from_config(config)
    by_name = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    assert mfu.matmul_params(config) == by_name
    # Tied output projection: the shared weight is still a matmul, so N does not change.
    assert mfu.matmul_params(preset_config("tiny-llama", tie_word_embeddings=True)) == by_name


def test_flops_per_token_attention_term_and_published_mfu():
    from harness.models import preset_config

    config = preset_config("tiny-llama")
    n = mfu.matmul_params(config)
    s1, s2 = 128, 512
    attention = 12 * config.num_hidden_layers * config.hidden_size
    assert mfu.flops_per_token(config, s1) == 6 * n + attention * s1
    assert mfu.flops_per_token(config, s2) - mfu.flops_per_token(config, s1) == attention * (s2 - s1)
    # torchtitan, Llama-3.1-8B, seq 8192 on H100: 5,762 tok/s/GPU, quoted MFU 33-39%
    # (../shared/PLATFORM.md). Our formula and table must land in that range.
    flops = mfu.flops_per_token(preset_config("llama3-8b"), 8192)
    value = mfu.mfu(5762, flops, mfu.peak_flops("NVIDIA H100 80GB HBM3", "bf16"))
    assert 0.33 <= value <= 0.39


def test_peak_flops_detection_and_override():
    cases = {
        "NVIDIA H100 80GB HBM3": "h100-sxm",
        "NVIDIA H100 PCIe": "h100-pcie",
        "NVIDIA H100 NVL": "h100-nvl",
        "NVIDIA H200": "h200-sxm",
        "NVIDIA GH200 480GB": "gh200",
        "NVIDIA A100-SXM4-80GB": "a100",
        "NVIDIA A100 80GB PCIe": "a100",
        "NVIDIA A10": "a10",
        "NVIDIA RTX A6000": "a6000",
        "NVIDIA RTX 6000 Ada Generation": "rtx6000-ada",
        "NVIDIA GeForce RTX 4090": "rtx4090",
        "NVIDIA L40S": "l40s",
        "NVIDIA L40": "l40",
        "NVIDIA L4": "l4",
        "Tesla V100-SXM2-16GB": "v100-sxm",
        "Tesla T4": "t4",
    }
    for name, key in cases.items():
        assert mfu.detect_gpu(name) == key, name
        assert mfu.peak_flops(name, "bf16") == mfu.PEAK_FLOPS[key].get("bf16")
    assert mfu.detect_gpu("Some Future GPU") is None
    assert mfu.peak_flops(None, "bf16") is None  # CPU: no MFU unless given
    assert mfu.peak_flops(None, "bf16", override=2.5e12) == 2.5e12
    assert mfu.peak_flops("NVIDIA H100 PCIe", "bf16", override=2.5e12) == 2.5e12
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert mfu.peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == mfu.PEAK_FLOPS["a100"]["fp32"]
        torch.set_float32_matmul_precision("high")
        assert mfu.peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == mfu.PEAK_FLOPS["a100"]["tf32"]
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_resumed_run_logs_each_step_once_and_keeps_the_abandoned_records(tmp_path):
    first = M.MetricsWriter(str(tmp_path))
    for step in range(1, 7):
        first.write("train", step, {M.TRAIN_LOSS: float(step)})
    first.write("summary", 6, {"final_eval_loss": 1.0})
    first.close()
    with open(tmp_path / M.METRICS_FILE, "a") as f:
        f.write('{"kind": "train", "step": 7, "tra')  # torn by a crash
    resumed = M.MetricsWriter(str(tmp_path), append=True, resumed_at=4)
    for step in range(5, 9):
        resumed.write("train", step, {M.TRAIN_LOSS: 10.0 + step})
    resumed.close()
    steps = [json.loads(line)["step"] for line in open(tmp_path / M.METRICS_FILE)]
    assert steps == list(range(1, 9))
    aside = open(tmp_path / M.SUPERSEDED_FILE).read().splitlines()
    assert [json.loads(line)["step"] for line in aside[:3]] == [5, 6, 6] and aside[3].startswith('{"kind": "train", "step": 7')
