"""Real published DeepSpeed and accelerate files (tests/data/dropin/, sources in its SOURCES.md)
drop in: each one is accepted and does what it says, or is refused in one line per problem.

The verdict is pre-flight's engine plan (`plan_engine`: the run config takes what the file or
the launcher sets, the file is resolved and checked by DeepSpeed's own config classes), made
in-process on this CPU-only machine, at 2 ranks (an accelerate file: its own num_processes),
with a run config that sets nothing but the model, as a user dropping a file in would. An
accelerate YAML becomes the environment `accelerate launch --config_file` gives the script,
by accelerate's own code. Two of the accepted files also train for real
(tests/integration/test_dropin_runs.py). On a GPU machine the fp16 files would be accepted
instead (not run here: no GPU).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from harness.config import load_config, load_strategy, resolve_deepspeed_config
from harness.engine import plan_engine
from harness.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DROPIN = REPO / "tests" / "data" / "dropin"
HIDDEN = 64  # tiny-llama's width: fills the files' "auto" bucket sizes
BF16_EXTRA = ("auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
FP16_CPU = "under DeepSpeed needs a GPU (DeepSpeed's fp16 optimizer and loss scaler run on CUDA) and this machine has none"

# file -> None (accepted) or the problem lines of its refusal, in order (a substring each)
VERDICTS: dict[str, list[str] | None] = {
    "tests/data/dropin/accelerate/zero_stage1_config.json": [f"precision=fp16 (from {{path}}'s fp16.enabled) {FP16_CPU}"],
    "tests/data/dropin/accelerate/zero_stage2_config.json": [f"precision=fp16 (from {{path}}'s fp16.enabled) {FP16_CPU}"],
    "tests/data/dropin/accelerate/zero_stage3_offload_config.json": [f"precision=fp16 (from {{path}}'s fp16.enabled) {FP16_CPU}"],
    "tests/data/dropin/accelerate/deepspeed.yaml": [f"precision=fp16 (from {{path}}'s fp16.enabled) {FP16_CPU}"],
    "tests/data/dropin/accelerate/zero_stage2_offload_config.json": [f"precision=fp16 (from {{path}}'s fp16.enabled) {FP16_CPU}"],
    "tests/data/dropin/accelerate/zero_stage3_config.json": [f"precision=fp16 (from {{path}}'s fp16.enabled) {FP16_CPU}"],
    "tests/data/dropin/axolotl/zero1.json": None,
    "tests/data/dropin/axolotl/zero1_torch_compile.json": [
        "unknown DeepSpeed key 'compile.disable' (DeepSpeed's CompileConfig has no such field)",
        "unknown DeepSpeed key 'compile.backend' (DeepSpeed's CompileConfig has no such field)",
    ],
    "tests/data/dropin/axolotl/zero2.json": None,
    "tests/data/dropin/axolotl/zero2_torch_compile.json": [
        "unknown DeepSpeed key 'compile.disable' (DeepSpeed's CompileConfig has no such field)",
        "unknown DeepSpeed key 'compile.backend' (DeepSpeed's CompileConfig has no such field)",
    ],
    "tests/data/dropin/axolotl/zero3.json": None,
    "tests/data/dropin/axolotl/zero3_bf16_cpuoffload_params.json": None,
    "tests/data/dropin/axolotl/zero3_cpuoffload.json": None,
    "tests/data/dropin/axolotl/zero3_bf16.json": None,
    "tests/data/dropin/axolotl/zero3_bf16_cpuoffload_all.json": None,
    "tests/data/dropin/deepspeedexamples/autotuning_ds_config_z1.json": None,
    "tests/data/dropin/deepspeedexamples/cifar_ds_config.json": [f"precision=fp16 (from {{path}}'s fp16.enabled) {FP16_CPU}"],
    "tests/data/dropin/deepspeedexamples/megatron_ds_zero2_config.json": [f"precision=fp16 (from {{path}}'s fp16.enabled) {FP16_CPU}"],
    "tests/data/dropin/llama-factory/ds_z0_config.json": None,
    "tests/data/dropin/llama-factory/ds_z2_config.json": None,
    "tests/data/dropin/llama-factory/ds_z3_offload_config.json": None,
    "tests/data/dropin/llama-factory/ds_z1_config_gaudi.json": None,
    "tests/data/dropin/llama-factory/ds_z2_offload_config.json": None,
    "tests/data/dropin/llama-factory/ds_z3_config.json": None,
    "tests/data/dropin/llama-factory/ds_z3_partial_offload_config.json": None,  # zero_force_ds_cpu_optimizer: DeepSpeedCPUAdam
    "tests/data/dropin/llama-factory/ds_z3_fp8_config.json": None,  # the same, and its `fp8` block DeepSpeed ignores (warned)
    "tests/data/dropin/llama-factory/ds_z3_alst_config.json": [
        "sequence_parallel (LLaMA-Factory's ALST block, size 4) is read by LLaMA-Factory, not DeepSpeed: set parallel.sequence=4",
        *(f"unknown DeepSpeed key 'bf16.{key}' (DeepSpeed's DeepSpeedBF16Config has no such field)" for key in BF16_EXTRA),
    ],
    "tests/data/dropin/llama-factory/ds_z2_autotp_config.json": ["tensor_parallel (AutoTP, size 2) splits each layer across ranks"],
    "tests/data/dropin/llama-factory/deepspeed_zero2_dpo.yaml": None,
    "tests/data/dropin/transformers/ds_config_zero2.json": None,
    "tests/data/dropin/transformers/ds_config_zero3.json": [
        f"precision=fp16 (from {{path}}'s fp16.enabled) {FP16_CPU}",
        "zero_optimization.reduce_bucket_size=0: Input should be greater than 0 (DeepSpeed's DeepSpeedZeroConfig)",
    ],
    "tests/data/dropin/trl/deepspeed_zero1.yaml": None,
    "tests/data/dropin/trl/deepspeed_zero2.yaml": None,
    "tests/data/dropin/trl/deepspeed_zero3.yaml": [f"precision=fp16 (from accelerate launch --mixed_precision fp16) {FP16_CPU}"],
    "tests/data/dropin/alignment-handbook/deepspeed_zero2.yaml": None,
    "tests/data/dropin/alignment-handbook/deepspeed_zero3.yaml": None,
}


def accelerate_env(yaml_path: Path) -> tuple[dict[str, str], int]:
    """The ACCELERATE_* variables `accelerate launch --config_file yaml_path` sets for the script
    (accelerate's own `_validate_launch_command` and `prepare_deepspeed_cmd_env`, as `launch_command`
    calls them) and its world size (num_processes; 2 where it says "auto")."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(yaml_path), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    assert args.use_deepspeed
    fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    world = int(args.num_processes) if str(args.num_processes).isdigit() else 2
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}, world


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), node)]


def _at(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        node = node[part]
    return node


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _verdict(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(plan or the ConfigError, the DeepSpeed file's path and dict, the run config, the launcher env)."""
    path = REPO / name
    env: dict[str, str] = {}
    world = 2
    if path.suffix == ".yaml":
        cwd = tmp_path / "examples" / "config_yaml_templates"  # accelerate's template names its file relative to here
        cwd.mkdir(parents=True)
        (tmp_path / "examples" / "deepspeed_config_templates").mkdir()
        shutil.copy(DROPIN / "accelerate" / "zero_stage1_config.json", tmp_path / "examples" / "deepspeed_config_templates")
        monkeypatch.chdir(cwd)
        env, world = accelerate_env(path)
    cfg = load_config(None, ["model.name=tiny-llama"])
    try:
        strategy = load_strategy(None if env else str(path), env=env)
        plan: Any = plan_engine(cfg, strategy, world, torch.device("cpu"), HIDDEN, env=env)
        cfg = plan.config  # the run config as resolved (the user's stays as written)
    except ConfigError as exc:
        plan = exc
    ds_path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path) if path.suffix == ".json" else "")
    return plan, ds_path, cfg, env


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_real_file_runs_as_written_or_is_refused_one_line_each(name, tmp_path, monkeypatch):
    plan, ds_path, cfg, env = _verdict(name, tmp_path, monkeypatch)
    expected = VERDICTS[name]
    if expected is not None:
        assert isinstance(plan, ConfigError), f"{name} was accepted"
        lines = str(plan).splitlines()
        problems = lines[1:] if len(lines) > 1 else [lines[0]]
        assert len(problems) == len(expected), lines
        for line, want in zip(problems, expected):
            assert want.format(path=ds_path) in line, (line, want)
        if len(lines) > 1:
            assert lines[0].endswith(f"{len(expected)} problems:")
        return
    assert not isinstance(plan, ConfigError), f"{name} refused: {plan}"
    assert plan.kind == "deepspeed"
    resolved = plan.deepspeed
    if ds_path:  # every value the file sets itself reaches DeepSpeed unchanged; every "auto" is filled
        raw = json.loads(Path(ds_path).read_text())
        for key, value in _leaves(raw):
            got = _at(resolved, key)
            if isinstance(value, str) and value.lower() == "auto":
                assert not (isinstance(got, str) and got.lower() == "auto"), key
            else:
                assert _same(value, got), (key, value, got)
        assert cfg.micro_batch_size == resolved["train_micro_batch_size_per_gpu"]
        opt = (raw.get("optimizer") or {}).get("params", {})
        if isinstance(opt.get("lr"), float):  # the file's own lr is the run's (optim.lr was not given)
            assert cfg.optim.lr == opt["lr"]
    else:  # an accelerate file without a DeepSpeed file: its settings chose and filled a shipped one
        y = yaml.safe_load((REPO / name).read_text())["deepspeed_config"]
        assert plan.zero_stage == y["zero_stage"]
        for what in ("offload_optimizer", "offload_param"):
            device = y.get(f"{what}_device", "none")
            assert ((resolved["zero_optimization"].get(what) or {}).get("device") or "none") == device
        if "gradient_accumulation_steps" in y:
            assert resolved["gradient_accumulation_steps"] == cfg.grad_accum == y["gradient_accumulation_steps"]
        if y.get("zero3_save_16bit_model") is not None and y["zero_stage"] == 3:
            assert resolved["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is y["zero3_save_16bit_model"]
    mixed = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if mixed != "no":
        assert cfg.precision == mixed and plan.precision.mode == mixed
    assert resolved["bf16"]["enabled"] is (cfg.precision == "bf16")


def test_every_collected_file_has_a_verdict_and_a_source():
    files = sorted(str(p.relative_to(DROPIN)) for p in DROPIN.glob("*/*") if p.suffix in (".json", ".yaml"))
    assert files == sorted(name.removeprefix("tests/data/dropin/") for name in VERDICTS)
    sources = (DROPIN / "SOURCES.md").read_text()
    assert all(f"| {f} |" in sources for f in files)
    projects = {f.split("/")[0] for f in files}
    assert len(files) >= 15 and len(projects) >= 4
    assert len([f for f in files if f.endswith(".json")]) >= 24  # DeepSpeed files of 5 projects, besides the accelerate YAMLs
    assert {p.suffix for p in DROPIN.glob("*/*")} >= {".json", ".yaml"}


# ------------------------------------------------------------------ the rules, each on a small file


def _file(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    return str(path)


def _plan(path: str, overrides: list[str] | None = None, env: dict[str, str] | None = None, accelerator: bool = False):
    cfg = load_config(None, ["model.name=tiny-llama", *(overrides or [])])
    plan = plan_engine(cfg, load_strategy(path, env=env or {}), 2, torch.device("cuda" if accelerator else "cpu"), HIDDEN, env=env or {})
    return plan, plan.config


def test_every_problem_named_in_one_refusal(tmp_path):
    path = _file(
        tmp_path,
        {
            "zero_optimisation": {"stage": 2},
            "train_micro_batch_size_per_gpu": 8,
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto"}},
            "pipeline": {"stages": 2},
            "fp16": {"enabled": False, "loss_scale": -1},
        },
    )
    with pytest.raises(ConfigError) as err:
        _plan(path, ["micro_batch_size=2"])
    lines = str(err.value).splitlines()
    assert lines[0] == f"{path}: 5 problems:", lines
    for want in (
        "unknown DeepSpeed key 'zero_optimisation' (did you mean 'zero_optimization'?)",
        "pipeline (DeepSpeed pipeline parallelism) needs a PipelineModule",
        "train_micro_batch_size_per_gpu=8 contradicts the run config's micro_batch_size=2",
        "'scheduler.params.cycle_min_lr' is 'auto' but harness cannot fill it",
        "fp16.loss_scale=-1",
    ):
        assert sum(want in line for line in lines[1:]) == 1, (want, lines)


def test_keys_deepspeed_ignores_are_accepted_and_warned(tmp_path):
    path = _file(tmp_path, {"_comment": "note", "cuda_visible_devices": "0,1", "zero_optimization": {"stage": 1}})
    plan, _ = _plan(path)
    assert [w.split("'")[1] for w in plan.deepspeed_ignored] == ["_comment", "cuda_visible_devices"]


def test_bfloat16_is_deepspeeds_old_name_for_bf16(tmp_path):
    path = _file(tmp_path, {"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    plan, cfg = _plan(path)
    assert cfg.precision == "bf16" and plan.precision.mode == "bf16"
    assert "bf16" not in plan.deepspeed and plan.deepspeed["bfloat16"] == {"enabled": True}
    with pytest.raises(ConfigError, match=r"bfloat16.enabled=True contradicts the run config's precision='fp32'"):
        _plan(path, ["precision=fp32"])
    auto = _file(tmp_path, {"bfloat16": {"enabled": "auto"}, "zero_optimization": {"stage": 1}})
    plan, _ = _plan(auto, ["precision=bf16"])
    assert plan.deepspeed["bfloat16"] == {"enabled": True} and "bf16" not in plan.deepspeed
    both = _file(tmp_path, {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    with pytest.raises(ConfigError, match="DeepSpeed reads only 'bf16': remove 'bfloat16'"):
        _plan(both)


def test_file_lr_is_taken_unless_the_run_config_gives_one(tmp_path):
    optimizer = {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999]}}
    path = _file(tmp_path, {"zero_optimization": {"stage": 1}, "optimizer": optimizer})
    plan, cfg = _plan(path)
    assert cfg.optim.lr == 3e-5 and cfg.optim.betas == (0.8, 0.999)
    assert any(t.startswith("optim.lr=3e-05 (from ") and "optimizer.params.lr" in t for t in plan.taken)
    with pytest.raises(ConfigError, match=r"optimizer.params.lr=3e-05 contradicts the run config's optim.lr=0.001"):
        _plan(path, ["optim.lr=0.001"])


def test_fp16_contradiction_on_cpu_points_away_from_fp16(tmp_path):
    path = _file(tmp_path, {"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match=r"fp16.enabled=True contradicts the run config's precision='fp32'; DeepSpeed's fp16 needs a GPU"):
        _plan(path, ["precision=fp32"])
    with pytest.raises(ConfigError, match=r"precision=fp16 \(from the run config's precision\) under DeepSpeed needs a GPU"):
        _plan("zero2", ["precision=fp16"])
    plan, cfg = _plan(path, accelerator=True)  # on a GPU the file's fp16 is the run's
    assert cfg.precision == "fp16" and plan.deepspeed["fp16"]["enabled"] is True
    from harness.planner.estimate import plan_for  # the planner plans for a GPU machine from this CPU one

    assert plan_for(load_config(None, ["precision=fp16"]), load_strategy("zero2", env={}), 2, HIDDEN).precision.mode == "fp16"


def test_launcher_settings_honoured_or_refused():
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
        "ACCELERATE_GRADIENT_CLIPPING": "0.5",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }
    plan, cfg = _plan(None, env=env)
    assert plan.strategy.offload_params == "cpu" and plan.strategy.offload_optimizer == "none"
    assert plan.deepspeed["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert (cfg.grad_accum, cfg.optim.grad_clip, cfg.precision) == (4, 0.5, "bf16")
    assert plan.deepspeed["gradient_accumulation_steps"] == 4 and plan.deepspeed["gradient_clipping"] == 0.5
    with pytest.raises(ConfigError) as err:
        _plan(None, ["grad_accum=2", "optim.grad_clip=1.0"], env=env)
    lines = str(err.value).splitlines()
    assert lines[0].endswith("2 problems:")
    assert "accelerate launch --gradient_accumulation_steps 4 contradicts the run config's grad_accum=2" in lines[1]
    assert "accelerate launch --gradient_clipping 0.5 contradicts the run config's optim.grad_clip=1.0" in lines[2]
    refused = {
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": ("false", "--zero3_init_flag false"),
        "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": ("MixtralSparseMoeBlock", "--deepspeed_moe_layer_cls_names"),
    }
    for var, (value, flag) in refused.items():
        with pytest.raises(ConfigError, match=rf"accelerate launch {flag}"):
            _plan(None, env={**env, var: value})


def test_launcher_stage_must_be_the_files(tmp_path):
    path = _file(tmp_path, {"zero_optimization": {"stage": 2}})
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": path, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    with pytest.raises(ConfigError, match=r"accelerate launch --zero_stage 3 contradicts zero_optimization.stage=2"):
        _plan(None, env=env)


def test_deprecated_cpu_offload_read_as_deepspeed_reads_it(tmp_path):
    strategy = load_strategy(_file(tmp_path, {"zero_optimization": {"stage": 2, "cpu_offload": True}}), env={})
    assert strategy.offload_optimizer == "cpu"


def test_zero_save_16bit_auto_takes_deepspeeds_default_without_a_launcher(tmp_path):
    path = _file(tmp_path, {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"}})
    filled: list[str] = []
    ds = resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, []), 1, HIDDEN, filled=filled, env={})
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    env = {"ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}
    ds = resolve_deepspeed_config(load_strategy(path, env={}), load_config(None, []), 1, HIDDEN, env=env)
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_deepspeed_checks_across_blocks_run_on_the_resolved_dict(tmp_path):
    path = _file(tmp_path, {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    with pytest.raises(ConfigError, match=r"DeepSpeed refuses the config: Bf16_master_weights_and_grads is only supported with ZeRO"):
        _plan(path)


def test_forced_ds_cpu_optimizer_is_deepspeed_cpu_adam_on_any_machine(tmp_path):
    fp8 = str(DROPIN / "llama-factory" / "ds_z3_fp8_config.json")
    plan, _ = _plan(fp8)
    assert plan.cpu_adam and plan.host_optimizer == "DeepSpeedCPUAdam, as ds_z3_fp8_config's zero_force_ds_cpu_optimizer asks"
    raw = json.loads(Path(fp8).read_text())
    del raw["zero_force_ds_cpu_optimizer"]
    without = _file(tmp_path, raw)
    assert not _plan(without)[0].cpu_adam  # CPU-only machine: torch's AdamW on the host
    assert _plan(without, accelerator=True)[0].cpu_adam  # a GPU machine: DeepSpeed's CPU Adam by default
    assert not _plan(without, env={"HARNESS_DS_CPU_ADAM": "0"}, accelerator=True)[0].cpu_adam
    with pytest.raises(ConfigError, match=r"zero_force_ds_cpu_optimizer: true asks for DeepSpeed's CPU optimizer .* optim.name='sgd'"):
        _plan(fp8, ["optim.name=sgd"])
    assert _plan(fp8, ["optim.name=adam"])[0].cpu_adam  # Adam too (DeepSpeedCPUAdam's adamw_mode off)


def test_nvme_offload_from_the_launcher_takes_accelerates_path_variable(tmp_path):
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"}
    with pytest.raises(ConfigError, match=r"nvme needs an NVMe path: export ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"):
        _plan(None, env=env)
    plan, _ = _plan(None, env={**env, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": str(tmp_path)})
    assert plan.deepspeed["zero_optimization"]["offload_param"] == {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}


def test_preflight_resolves_into_a_read_only_copy_and_leaves_the_users_config_as_written(tmp_path, monkeypatch):
    """Pre-flight is the one resolution step: a DeepSpeed file's own micro batch is taken into the
    config it returns (`plan.config`), which no component may change afterwards; the user's config
    is not written to. In-process, about a second."""
    import copy
    from dataclasses import FrozenInstanceError

    from harness.runner import preflight

    for key in [k for k in __import__("os").environ if k.startswith(("ACCELERATE_", "HARNESS_"))]:
        monkeypatch.delenv(key)
    path = _file(tmp_path, {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}})
    user = load_config(None, ["model.name=tiny-llama", f"strategy={path}", f"output_dir={tmp_path / 'run'}"])
    plan = preflight(user, load_strategy(path, env={}))
    assert (user.micro_batch_size, plan.config.micro_batch_size) == (4, 8)
    assert any("micro_batch_size=8" in note for note in plan.taken)
    with pytest.raises(FrozenInstanceError, match="read-only"):
        plan.config.optim.lr = 1.0
    with pytest.raises(FrozenInstanceError):
        plan.config.steps = 1
    variant = copy.deepcopy(plan.config)  # a variant (the planner's, the check's twin) is writable
    variant.optim.lr = 1.0
    assert plan.config.optim.lr != 1.0


def test_sequence_parallel_size_is_taken_as_parallel_sequence_and_batches_count_data_parallel_ranks(tmp_path):
    """DeepSpeed's `sequence_parallel_size` is its Ulysses degree: taken into `parallel.sequence` where
    the run config leaves it unset (harness runs ALST for it), refused where the two differ; the batch
    arithmetic counts the data-parallel ranks (world / degree), as DeepSpeed's own config does under ALST."""
    path = _file(tmp_path, {"zero_optimization": {"stage": 2}, "sequence_parallel_size": 2, "train_batch_size": 8})
    plan, cfg = _plan(path)  # world 2: one data-parallel rank
    assert cfg.parallel.sequence == 2 and "parallel.sequence=2 (from" in " ".join(plan.taken)
    assert not plan.deepspeed_ignored  # read by DeepSpeed inside a process group, where the key probe does not reach
    assert cfg.grad_accum * cfg.micro_batch_size == 8 and plan.deepspeed["train_batch_size"] == 8
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=2 contradicts the run config's parallel.sequence=1"):
        _plan(path, ["parallel.sequence=1"])
    plan, _ = _plan(_file(tmp_path, {"zero_optimization": {"stage": 2}}), ["parallel.sequence=2", "grad_accum=3"])
    assert plan.deepspeed["sequence_parallel_size"] == 2 and plan.deepspeed["train_batch_size"] == plan.config.micro_batch_size * 3
    assert "sequence_parallel_size" not in _plan(_file(tmp_path, {"zero_optimization": {"stage": 2}}))[0].deepspeed
