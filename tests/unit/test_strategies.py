"""Strategy files: shipped set, DeepSpeed 'auto' filling, contradictions, launcher hints."""
import json
import os

import pytest

from harness.config import load_config
from harness.config.checks import check_strategy_against_run
from harness.config.strategies import DS_CONFIG_DIR, load_strategy, resolve_deepspeed_config, strategy_from_launcher
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


def test_unfillable_auto_is_an_error(tmp_path):
    path = _user_file(tmp_path, {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}})
    with pytest.raises(ConfigError, match="zero_optimization.sub_group_size' is 'auto'"):
        resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, []), 1, 64)


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


def test_fsdp_offload_needs_accelerator():
    with pytest.raises(ConfigError, match="FSDP2 CPU offload needs a GPU"):
        check_strategy_against_run(load_strategy("fsdp_offload", env={}), load_config(None, []), has_accelerator=False)
    check_strategy_against_run(load_strategy("fsdp_offload", env={}), load_config(None, []), has_accelerator=True)


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
