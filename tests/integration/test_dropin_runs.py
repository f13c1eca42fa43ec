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

- LLaMA-Factory's `ds_z3_fp8_config.json` (ZeRO-3, optimizer offloaded, no optimizer block,
  `zero_force_ds_cpu_optimizer: true`) under torchrun: DeepSpeedCPUAdam steps (said in the
  start-up line) and the losses are those of the same file without the key (torch's AdamW).
- TRL's `fsdp2_sharding_2gpus.yaml` under `accelerate launch --config_file`: its
  `parallelism_config` (dp_shard 2) runs as FSDP2 over both ranks, its
  `fsdp_activation_checkpointing: true` becomes the run's activation checkpointing, its bf16 the
  run's precision; each rank holds half the fp32 parameters.

The verdict on every collected file is tests/unit/test_dropin.py (in-process).
"""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def cpu_adam_and_fsdp_runs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path, tiny_data) -> dict:
    root = tmp_path_factory.mktemp("dropin2")
    fp8 = DROPIN / "llama-factory" / "ds_z3_fp8_config.json"
    without = json.loads(fp8.read_text())
    del without["zero_force_ds_cpu_optimizer"]
    (root / "without_key.json").write_text(json.dumps(without))

    def torchrun(name: str, strategy: Path):
        out = root / name
        cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", TRAIN]
        cmd += ["--config", str(_config(root / f"{name}.yaml", data_cache, out)), f"strategy={strategy}", "steps=3"]
        return lambda: (out, run(cmd, timeout=420))

    fsdp_out = root / "fsdp"
    accelerate = [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(REPO / "tests" / "data" / "accelerate_fsdp" / "trl_fsdp2_sharding_2gpus.yaml"),
    ]
    accelerate += ["--main_process_port", str(free_port()), TRAIN, "--config", str(_config(root / "fsdp.yaml", data_cache, fsdp_out))]
    jobs = [torchrun("forced", fp8), torchrun("without", root / "without_key.json"), lambda: (fsdp_out, run(accelerate, timeout=420))]
    return {name: (out, p.stdout + p.stderr) for name, (out, p) in zip(("forced", "without", "fsdp"), side_by_side(*jobs))}


def test_forced_ds_cpu_optimizer_builds_deepspeed_cpu_adam_with_the_same_losses(cpu_adam_and_fsdp_runs):
    (forced, log), (without, log_without) = cpu_adam_and_fsdp_runs["forced"], cpu_adam_and_fsdp_runs["without"]
    assert "optim adamw (DeepSpeedCPUAdam, as ds_z3_fp8_config's zero_force_ds_cpu_optimizer asks)" in log, log[-3000:]
    assert "DeepSpeedCPUAdam" not in log_without and "zero_force_ds_cpu_optimizer=False (the client optimizer AdamW" in log_without
    losses, reference = step_losses(forced), step_losses(without)
    assert len(losses) == 3 and losses == pytest.approx(reference, rel=1e-6), (losses, reference)
    assert losses[2] < losses[0]  # the optimizer stepped


def test_trl_fsdp2_parallelism_file_shards_and_checkpoints_activations(cpu_adam_and_fsdp_runs):
    out, log = cpu_adam_and_fsdp_runs["fsdp"]
    assert "memory.activation_checkpointing='full' (from accelerate launch --fsdp_activation_checkpointing true" in log, log[-3000:]
    assert "precision='bf16' (from accelerate launch --mixed_precision bf16" in log
    assert "accelerate launch --fsdp_state_dict_type FULL_STATE_DICT: checkpoints are sharded" in log
    assert "fsdp (fsdp) x2 on cpu, bf16" in log
    assert len(step_losses(out)) == 2
    for rank in (0, 1):
        held = state_bytes(out, rank)
        assert held["params"] == pytest.approx(2 * N_PARAMS, rel=0.05), held  # half of the fp32 parameters
