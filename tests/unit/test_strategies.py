"""Strategy files: shipped set, DeepSpeed 'auto' filling, contradictions, launcher hints."""

import json
import os

import pytest

from harness.config import DS_CONFIG_DIR, load_config, load_strategy, resolve_deepspeed_config
from harness.config.checks import check_strategy_against_run
from harness.config.strategies import strategy_from_launcher
from harness.errors import ConfigError

SHIPPED = ["ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme", "fsdp", "fsdp_grad_op", "fsdp_offload"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_strategies_load(name):
    s = load_strategy(name, env={})
    assert os.path.dirname(s.path) == DS_CONFIG_DIR
    expected_kind = "ddp" if name == "ddp" else "fsdp" if name.startswith("fsdp") else "deepspeed"
    assert s.kind == expected_kind
    if name.startswith("zero"):
        assert s.zero_stage == int(name[4])
    if name == "fsdp_grad_op":
        assert s.reshard_after_forward is False and s.zero_stage == 2
    if name in ("zero3_offload", "zero3_nvme"):
        assert s.offload_params == ("cpu" if name == "zero3_offload" else "nvme")


def test_auto_values_filled_from_run_config():
    cfg = load_config(None, ["micro_batch_size=3", "grad_accum=2", "precision=bf16", "optim.grad_clip=0.5"])
    ds = resolve_deepspeed_config(load_strategy("zero2", env={}), cfg, world_size=4, hidden_size=64)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 24
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False


@pytest.mark.parametrize("name", ["zero3", "zero3_offload", "zero3_nvme"])
def test_shipped_zero3_files_release_parameters_after_about_two_blocks(name, tmp_path):
    # DeepSpeed's own 1e9 keeps every parameter of a model under ~500M gathered from step 2 on
    cfg = load_config(None, [])
    filled: list[str] = []
    strategy = load_strategy(name, env={})
    for off in ("offload_param", "offload_optimizer"):  # the NVMe file names a path: point it at a writable one
        if (strategy.raw["zero_optimization"].get(off) or {}).get("device") == "nvme":
            strategy.raw["zero_optimization"][off]["nvme_path"] = str(tmp_path)
    ds = resolve_deepspeed_config(strategy, cfg, world_size=2, hidden_size=1024, filled=filled)
    zero = ds["zero_optimization"]
    assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == 24 * 1024**2
    assert any(line.startswith("zero_optimization.stage3_max_reuse_distance=") for line in filled)
    own = _user_file(tmp_path, {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 5}})
    assert resolve_deepspeed_config(load_strategy(own, env={}), cfg, 2, 1024)["zero_optimization"]["stage3_max_reuse_distance"] == 5


def _user_file(tmp_path, data):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_contradiction_names_both_values(tmp_path):
    path = _user_file(tmp_path, {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}})
    cfg = load_config(None, ["micro_batch_size=4"])
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=16 contradicts the run config's micro_batch_size=4"):
        resolve_deepspeed_config(load_strategy(path, env={}), cfg, 2, 64)


def test_batch_arithmetic_disagreement(tmp_path):
    path = _user_file(tmp_path, {"train_batch_size": 100, "zero_optimization": {"stage": 1}})
    cfg = load_config(None, ["micro_batch_size=4", "grad_accum=2"])
    with pytest.raises(ConfigError, match="train_batch_size=100 contradicts"):
        resolve_deepspeed_config(load_strategy(path, env={}), cfg, 2, 64)


def test_precision_contradiction(tmp_path):
    path = _user_file(tmp_path, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match="bf16.enabled=True contradicts the run config's precision='fp32'"):
        resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, []), 1, 64)


def test_zero_auto_harness_cannot_fill_gets_deepspeeds_default(tmp_path):
    # DeepSpeed's own models drop an "auto" and use the field's default; harness fills that default and says so
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}})
    filled = []
    ds = resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, []), 1, 64, filled=filled)
    assert ds["zero_optimization"]["sub_group_size"] == 1e9
    assert any(f.startswith("zero_optimization.sub_group_size=1000000000 (from DeepSpeed's default") for f in filled)


def test_optimizer_auto_filled(tmp_path):
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 2}, "optimizer": {"type": "auto", "params": {"lr": "auto"}}})
    ds = resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, ["optim.lr=0.02"]), 1, 64)
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == 0.02


@pytest.mark.parametrize("stage", [4, -1, "two"])
def test_zero_stage_out_of_range(tmp_path, stage):
    path = _user_file(tmp_path, {"zero_optimization": {"stage": stage}})
    with pytest.raises(ConfigError, match="stage must be 0, 1, 2 or 3"):
        load_strategy(path, env={})


def test_nvme_path_must_be_writable():
    with pytest.raises(ConfigError, match="nvme_path='/local_nvme' is missing or not writable"):
        resolve_deepspeed_config(load_strategy("zero3_nvme", env={}), load_config(None, []), 1, 64)


def test_nvme_path_accepted_when_writable(tmp_path):
    data = json.load(open(os.path.join(DS_CONFIG_DIR, "zero3_nvme.json")))
    for key in ("offload_optimizer", "offload_param"):
        data["zero_optimization"][key]["nvme_path"] = str(tmp_path)
    ds = resolve_deepspeed_config(load_strategy(_user_file(tmp_path, data), env={}), load_config(None, []), 1, 64)
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)


def test_fsdp_offload_is_accepted_with_or_without_an_accelerator():
    """CPUOffloadPolicy without pinned memory runs on a CPU machine, the host being the device (a
    correctness run: tests/integration/test_launch_sharding.py trains it at world 2)."""
    for accelerator in (False, True):
        check_strategy_against_run(load_strategy("fsdp_offload", env={}), load_config(None, []), has_accelerator=accelerator)


def test_optimizer_in_backward_rejected_under_deepspeed():
    cfg = load_config(None, ["memory.optimizer_in_backward=true"])
    with pytest.raises(ConfigError, match="DeepSpeed owns the optimizer step"):
        check_strategy_against_run(load_strategy("zero2", env={}), cfg, has_accelerator=False)


def test_unknown_key_in_our_schema(tmp_path):
    path = _user_file(tmp_path, {"kind": "fsdp", "reshard_after_foward": True})
    with pytest.raises(ConfigError, match="did you mean 'reshard_after_forward'"):
        load_strategy(path, env={})


def test_unknown_strategy_name():
    with pytest.raises(ConfigError, match="did you mean 'zero2'"):
        load_strategy("zer02", env={})


def test_launcher_hints():
    assert strategy_from_launcher({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}) == "zero3"
    assert strategy_from_launcher({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}) == "fsdp_grad_op"
    assert strategy_from_launcher({"ACCELERATE_USE_FSDP": "true"}) == "fsdp"
    assert strategy_from_launcher({}) is None
    assert load_strategy(None, env={"ACCELERATE_USE_FSDP": "true"}).kind == "fsdp"
    with pytest.raises(ConfigError, match="accelerate launch asked for 'zero2'"):
        load_strategy("fsdp", env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})


# ------------------------------------------------------------------ a drop-in DeepSpeed file is honoured exactly


def test_file_scheduler_kept_and_its_autos_filled(tmp_path):
    sched = {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
            "warmup_max_lr": "auto",
            "warmup_min_lr": "auto",
            "warmup_type": "linear",
        },
    }
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 2}, "scheduler": sched})
    cfg = load_config(None, ["steps=40", "optim.lr=0.002", "optim.warmup_steps=3", "optim.min_lr_ratio=0.25"])
    filled = []
    ds = resolve_deepspeed_config(load_strategy(path, env={}), cfg, 1, 64, filled=filled)
    assert ds["scheduler"] == {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_num_steps": 3,
            "total_num_steps": 40,
            "warmup_max_lr": 0.002,
            "warmup_min_lr": 0.002 * 0.25,
            "warmup_type": "linear",
        },
    }
    assert "scheduler.params.total_num_steps=40 (from steps)" in filled


def test_file_scheduler_auto_it_cannot_fill_is_an_error(tmp_path):
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 2}, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto"}}})
    with pytest.raises(ConfigError, match="'scheduler.params.cycle_min_lr' is 'auto'"):
        resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, []), 1, 64)


def test_auto_scheduler_means_harness_schedule(tmp_path):
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 2}, "scheduler": {"type": "auto", "params": {}}})
    filled = []
    ds = resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, []), 1, 64, filled=filled)
    assert "scheduler" not in ds and any(f.startswith("scheduler=harness's cosine schedule") for f in filled)


def test_lr_scheduler_argument_decides_which_schedule_runs(tmp_path):
    import torch

    from harness.engine.deepspeed_engine import deepspeed_lr_scheduler
    from harness.training import lr_lambda

    cfg = load_config(None, ["steps=20", "optim.lr=0.01", "optim.warmup_steps=4"])
    kept = _user_file(tmp_path, {"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7}}})
    assert deepspeed_lr_scheduler(resolve_deepspeed_config(load_strategy(kept, env={}), cfg, 1, 64), cfg) is None
    ours = deepspeed_lr_scheduler(resolve_deepspeed_config(load_strategy("zero2", env={}), cfg, 1, 64), cfg)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    sched = ours(opt)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    assert sched.get_last_lr()[0] == pytest.approx(cfg.optim.lr * lr_lambda(cfg.optim, cfg.steps)(0))


def test_deepspeed_builds_the_file_scheduler(tmp_path):
    """DeepSpeed's own scheduler choice (`_configure_lr_scheduler`, a client scheduler beats the
    config's) given what `_deepspeed_engine` passes: the file's WarmupLR, with its autos filled."""
    import types

    import torch
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.lr_schedules import WarmupLR

    from harness.engine.deepspeed_engine import deepspeed_lr_scheduler

    cfg = load_config(None, ["optim.lr=0.01", "optim.warmup_steps=6"])
    path = _user_file(
        tmp_path,
        {
            "zero_optimization": {"stage": 1},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto", "warmup_min_lr": 0}},
        },
    )
    ds = resolve_deepspeed_config(load_strategy(path, env={}), cfg, 1, 64)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    conf = DeepSpeedConfig(ds)
    engine = types.SimpleNamespace(
        client_lr_scheduler=deepspeed_lr_scheduler(ds, cfg),
        basic_optimizer=opt,
        optimizer=opt,
        scheduler_name=lambda: conf.scheduler_name,
        scheduler_params=lambda: conf.scheduler_params,
    )
    engine._scheduler_from_config = types.MethodType(DeepSpeedEngine._scheduler_from_config, engine)
    DeepSpeedEngine._configure_lr_scheduler(engine)
    assert isinstance(engine.lr_scheduler, WarmupLR)
    assert engine.lr_scheduler.warmup_num_steps == 6 and engine.lr_scheduler.max_lrs == [0.01]


def test_optimizer_number_contradicting_run_config_names_both(tmp_path):
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 0.0001}}})
    with pytest.raises(ConfigError, match=r"optimizer.params.lr=0.0001 contradicts the run config's optim.lr=0.003"):
        resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, ["optim.lr=0.003"]), 1, 64)
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999]}}})
    with pytest.raises(ConfigError, match=r"optimizer.params.betas=\[0.9, 0.999\] contradicts the run config's optim.betas=\[0.9, 0.95\]"):
        resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, []), 1, 64)
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb", "params": {}}})
    with pytest.raises(ConfigError, match="optimizer.type='Lamb' contradicts the run config's optim.name='adamw'"):
        resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, []), 1, 64)


def test_optimizer_values_equal_to_run_config_pass(tmp_path):
    path = _user_file(
        tmp_path,
        {
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": "auto"}},
        },
    )
    filled = []
    ds = resolve_deepspeed_config(
        load_strategy(path, env={}), load_config(None, ["optim.lr=0.003", "optim.weight_decay=0.1"]), 1, 64, filled=filled
    )
    assert ds["optimizer"]["params"] == {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1e-8}
    assert "optimizer.params.weight_decay=0.1 (from optim.weight_decay)" in filled
    assert not any(f.startswith("optimizer.params.lr=") for f in filled)


def test_filled_names_gradient_clipping_the_file_left_out(tmp_path):
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4})
    filled = []
    ds = resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, ["optim.grad_clip=0.7"]), 1, 64, filled=filled)
    assert ds["gradient_clipping"] == 0.7
    assert "gradient_clipping=0.7 (from optim.grad_clip)" in filled
    assert not any(f.startswith("train_micro_batch_size_per_gpu=") for f in filled)  # written in the file, not filled


@pytest.mark.parametrize(
    "data, key, hint",
    [
        ({"zero_optimisation": {"stage": 2}}, "zero_optimisation", "zero_optimization"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 10}}, "zero_optimization.reduce_bucket_sise", "reduce_bucket_size"),
        (
            {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket": 10}},
            "zero_optimization.stage3_prefetch_bucket",
            "stage3_prefetch_bucket_size",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
            "zero_optimization.offload_param.pin_memroy",
            "pin_memory",
        ),
    ],
)
def test_misspelt_deepspeed_key_names_the_right_one(tmp_path, data, key, hint):
    with pytest.raises(ConfigError, match=rf"unknown DeepSpeed key '{key}' \(did you mean '{hint}'\?\)"):
        resolve_deepspeed_config(load_strategy(_user_file(tmp_path, data), env={}), load_config(None, []), 1, 64)


def test_documented_deepspeed_keys_accepted(tmp_path):
    from harness.config.deepspeed_keys import deepspeed_top_level_keys

    documented = {
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "zero_optimization",
        "gradient_clipping",
        "steps_per_print",
        "wall_clock_breakdown",
        "activation_checkpointing",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "comms_logger",
        "data_types",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        "sparse_gradients",
        "amp",
        "checkpoint",
        "aio",
        "elasticity",
        "autotuning",
        "pipeline",
        "compression_training",
    }
    assert documented <= deepspeed_top_level_keys()
    load_strategy(_user_file(tmp_path, {"comment": "harness's own note", "zero_optimization": {"stage": 2}}), env={})


def test_alst_under_an_older_deepspeed_is_one_line_and_setup_cfg_floors_it(monkeypatch):
    import configparser
    from pathlib import Path

    from harness.config import load_config, load_strategy, sequence_checks

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    requires = [r.strip() for r in setup["options"]["install_requires"].splitlines() if r.strip().startswith("deepspeed")]
    assert requires == [f"deepspeed>={sequence_checks.ALST_MIN_DEEPSPEED}"]
    cfg = load_config(None, ["parallel.sequence=2", "data.packing=false"])
    monkeypatch.setattr(sequence_checks.importlib.metadata, "version", lambda name: "0.17.6" if name == "deepspeed" else "1")
    with pytest.raises(sequence_checks.ConfigError, match=r"needs deepspeed>=0\.18\.2 \(installed: 0\.17\.6\)"):
        sequence_checks.check_sequence_engine(cfg, load_strategy("zero2", env={}))
    monkeypatch.setattr(sequence_checks.importlib.metadata, "version", lambda name: "0.19.8+cu128")
    sequence_checks.check_sequence_engine(cfg, load_strategy("zero2", env={}))
