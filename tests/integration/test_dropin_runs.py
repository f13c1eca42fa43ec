"""Two of the real drop-in files (tests/data/dropin/) train for real, as their users launch them:
2 ranks, tiny Llama, 2 steps, a run config that sets nothing the file sets.

- LLaMA-Factory's ZeRO-0 file under torchrun: its keys DeepSpeed ignores (`comms_config`,
  `monitor_config`) are warned once and the run trains; at stage 0 every rank holds the whole
  AdamW state (two fp32 moments: 2x the fp32 parameter bytes), which the per-rank state
  bytes report (they once reported 0).
- The alignment-handbook's ZeRO-3 accelerate YAML under `accelerate launch --config_file`
  (its num_processes set to 2 on the command line, as on any machine with another count):
  `--mixed_precision bf16` becomes the run's precision, `--offload_param_device cpu` and
  `--offload_optimizer_device cpu` the offload, `--zero3_save_16bit_model true` the file's
  16-bit save setting; each rank holds half the bf16 parameters and half the fp32 masters.

The verdict on every collected file is tests/unit/test_dropin.py (in-process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from launching import BIN, REPO, TINY_DATA, TRAIN, run, side_by_side, state_bytes, step_losses

from harness.distributed import free_port

DROPIN = REPO / "tests" / "data" / "dropin"
N_PARAMS = 158_016  # tiny-llama at vocab 512 (printed by the run and checked below)


def _config(path: Path, cache: Path, output: Path) -> Path:
    """Only what the file cannot say: the model, the data, the length of the run, the output."""
    cfg = {
        "model": {"name": "tiny-llama"},
        "data": {**TINY_DATA, "cache_dir": str(cache)},
        "steps": 2,
        "eval_batches": 1,
        "logging": {"wandb": False, "progress": False, "plots": False},
        "output_dir": str(output),
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path, tiny_data) -> dict:
    root = tmp_path_factory.mktemp("dropin")
    z0, z3 = root / "z0", root / "z3"
    torchrun = [
        str(BIN / "torchrun"),
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        TRAIN,
        "--config",
        str(_config(root / "z0.yaml", data_cache, z0)),
        f"strategy={DROPIN / 'llama-factory' / 'ds_z0_config.json'}",
    ]
    accelerate = [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(DROPIN / "alignment-handbook" / "deepspeed_zero3.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        TRAIN,
        "--config",
        str(_config(root / "z3.yaml", data_cache, z3)),
    ]
    p0, p3 = side_by_side(lambda: run(torchrun, timeout=420), lambda: run(accelerate, timeout=420))
    return {"z0": (z0, p0.stdout + p0.stderr), "z3": (z3, p3.stdout + p3.stderr)}


def test_zero0_file_trains_warns_ignored_keys_and_counts_the_optimizer_state(runs):
    out, log = runs["z0"]
    assert f"{N_PARAMS:,} params" in log
    for key in ("comms_config", "monitor_config"):
        assert log.count(f"'{key}' is not a key DeepSpeed reads; DeepSpeed ignores it") == 1, log[-3000:]
    assert len(step_losses(out)) == 2
    P = 4 * N_PARAMS
    for rank in (0, 1):
        held = state_bytes(out, rank)
        assert held["params"] == P and held["optim_state"] == 2 * P, held


def test_accelerate_yaml_settings_are_the_runs(runs):
    out, log = runs["z3"]
    assert "precision='bf16' (from accelerate launch --mixed_precision bf16" in log
    assert "zero3_offload (deepspeed) x2 on cpu, bf16" in log  # --offload_*_device cpu at --zero_stage 3
    assert "stage3_gather_16bit_weights_on_model_save=True (from accelerate launch --zero3_save_16bit_model true)" in log
    assert len(step_losses(out)) == 2
    for rank in (0, 1):
        held = state_bytes(out, rank)
        # half of the bf16 parameters and of the fp32 masters per rank (DeepSpeed pads partitions a little)
        assert held["params"] == pytest.approx(N_PARAMS, rel=0.05) and held["master_params"] == pytest.approx(2 * N_PARAMS, rel=0.05), held
