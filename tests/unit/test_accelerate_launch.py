"""`accelerate launch`: every flag, config-file key and variable has one verdict
(harness.config.accelerate_table), docs/strategies.md's table is that table, and the verdicts hold.

The lists are taken from accelerate's own code (its launch parser, its config dataclass, the
variables its launcher sets), so a flag a new accelerate adds fails here until it has a verdict.
Published FSDP files (tests/data/accelerate_fsdp/) are turned into the script's environment by
accelerate's own `_validate_launch_command` and `prepare_multi_gpu_env`, as `accelerate launch
--config_file` does, and planned in-process at their own world size.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import launch as accelerate_launch_env
from accelerate.utils.launch import prepare_multi_gpu_env

from harness.config import load_config, load_strategy
from harness.config.accelerate_launch import launcher_settings, launcher_values, parallelism_problems
from harness.config.accelerate_table import CONFIG_KEYS, FLAGS, REFUSED, SECTION_ONLY_KEYS, VARIABLES, flag_of
from harness.engine import plan_engine
from harness.errors import ConfigError
from harness.runner.preflight import check_wrap_classes

REPO = Path(__file__).resolve().parents[2]
FILES = REPO / "tests" / "data" / "accelerate_fsdp"


def _dests() -> list[str]:
    return [a.dest for a in launch_command_parser()._actions if a.dest != "help"]


def test_every_flag_has_one_verdict_and_every_row_a_flag():
    dests = _dests()
    assert len(dests) > 100  # accelerate 1.15: 125
    for dest in dests:
        verdict, what = flag_of(dest)
        assert verdict in ("launcher", "honoured", "said", "refused") and what, dest
    for name in set(FLAGS) - set(SECTION_ONLY_KEYS):
        assert any(d == name or (name.endswith("*") and d.startswith(name[:-1])) for d in dests), f"{name} is no flag of accelerate"


def test_every_config_file_key_has_a_row():
    assert set(CONFIG_KEYS) == {f.name for f in dataclasses.fields(ClusterConfig)}


def test_every_variable_the_launcher_sets_has_its_flag():
    names: set[str] = set()
    for _, function in inspect.getmembers(accelerate_launch_env, inspect.isfunction):
        source = inspect.getsource(function)
        names |= set(re.findall(r'current_env\["([A-Z0-9_]+)"\]', source))
        prefixes = re.findall(r'prefix = "([A-Z0-9_]+)"', source)  # current_env[prefix + "X"], one prefix per function
        assert len(prefixes) <= 1, function.__name__
        names |= {prefix + n for prefix in prefixes for n in re.findall(r'current_env\[prefix \+ "([A-Z0-9_]+)"\]', source)}
    names |= {"ACCELERATE_FP8_BACKEND"}  # current_env[f"{prefix}{arg.upper()}"] for every fp8_* flag
    assert len(names) > 60
    for name in sorted(names):
        row = VARIABLES.get(name) or next((v for k, v in VARIABLES.items() if k.endswith("*") and name.startswith(k[:-1])), None)
        assert row is not None, f"{name} (set by accelerate's launcher) has no row in VARIABLES"
    for flag in VARIABLES.values():
        flag_of(flag)


def _readme_rows(heading: str) -> dict[str, tuple[str, ...]]:
    text = (REPO / "docs" / "strategies.md").read_text()
    table = text[text.index(heading) :].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = tuple(c.strip() for c in line.strip().strip("|").split(" | "))
        rows[cells[0]] = cells[1:]
    return rows


def test_readme_tables_are_the_code_tables():
    flags = _readme_rows("accelerate launch flag | harness")
    assert flags == {f"`--{name}`": (verdict, what) for name, (verdict, what) in FLAGS.items()}
    keys = _readme_rows("accelerate config file key | the flags it sets")
    assert keys == {f"`{name}`": (what,) for name, what in CONFIG_KEYS.items()}


# Each refused flag with a variable of its own, set to a value harness does not do, in an FSDP2
# launch at world 4 with accelerate's parallelism config on; the rest are read only with a size refused here.
REFUSE: dict[str, tuple[str, str]] = {
    "enable_cpu_affinity": ("ACCELERATE_CPU_AFFINITY", "1"),
    "debug": ("ACCELERATE_DEBUG_MODE", "true"),
    "use_megatron_lm": ("ACCELERATE_USE_MEGATRON_LM", "true"),
    "deepspeed_moe_layer_cls_names": ("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", "MixtralSparseMoeBlock"),
    "dynamo_mode": ("ACCELERATE_DYNAMO_MODE", "max-autotune"),
    "dynamo_use_fullgraph": ("ACCELERATE_DYNAMO_USE_FULLGRAPH", "True"),
    "dynamo_use_dynamic": ("ACCELERATE_DYNAMO_USE_DYNAMIC", "True"),
    "fsdp_activation_checkpointing_offload": ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true"),
    "fsdp_ignored_modules": ("FSDP_IGNORED_MODULES", "LlamaMLP"),
    "parallelism_config_tp_size": ("PARALLELISM_CONFIG_TP_SIZE", "2"),
    "parallelism_config_cp_size": ("PARALLELISM_CONFIG_CP_SIZE", "2"),
}
READ_ONLY_WITH_A_REFUSED_SIZE = {
    "parallelism_config_cp_backend",
    "parallelism_config_cp_comm_strategy",
    "megatron_lm_*",  # set only with --use_megatron_lm
    "fp8_*",  # set only with --mixed_precision fp8
}
FSDP_WORLD_4 = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
}


def _problems(env: dict[str, str], world: int = 4, kind: str = "fsdp") -> list[str]:
    notes, problems = launcher_settings(env, world, kind)
    launcher_values(env, problems)
    return problems


def test_every_refused_flag_is_refused_in_one_line_naming_it():
    refused = {name for name, (verdict, _) in FLAGS.items() if verdict == REFUSED}
    assert refused == set(REFUSE) | READ_ONLY_WITH_A_REFUSED_SIZE
    for flag, (var, value) in REFUSE.items():
        shard = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"} if flag.startswith("parallelism") else {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "4"}
        env = {**FSDP_WORLD_4, **shard, var: value}
        problems = _problems(env)
        assert len(problems) == 1 and f"--{flag}" in problems[0], (flag, problems)
        assert _problems({**FSDP_WORLD_4, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4"}) == []  # without it: none


@pytest.mark.parametrize(
    "sizes, world, kind, refusal",
    [
        ({"DP_SHARD": "2"}, 2, "fsdp", None),  # TRL's fsdp2_sharding_2gpus: plain FSDP2
        ({"DP_REPLICATE": "2", "DP_SHARD": "1"}, 2, "ddp", None),  # replicas only: DDP
        ({"DP_SHARD": "2"}, 2, "deepspeed", None),
        ({"DP_REPLICATE": "2", "DP_SHARD": "2"}, 4, "fsdp", "asks for hybrid sharding (HSDP), which harness does not do"),
        ({"DP_REPLICATE": "2", "DP_SHARD": "1"}, 2, "fsdp", "keeps the whole model on every rank (DDP) but the strategy shards"),
        ({"DP_SHARD": "2"}, 4, "fsdp", "sizes multiply to 2 but the launch started 4 processes"),
        ({"DP_SHARD": "2"}, 2, "ddp", "shards the model, but the strategy is DDP: launch with --use_fsdp"),
        ({"DP_SHARD": "2", "SP": "2"}, 2, "fsdp", "sizes multiply to 4 but the launch started 2 processes"),
        ({"DP_SHARD": "1", "CP": "2"}, 2, "fsdp", "(context parallelism, ring attention) is not in harness"),
        ({"DP_SHARD": "1", "TP": "2"}, 2, "fsdp", "(tensor parallelism): harness trains data-parallel only"),
    ],
)
def test_parallelism_sizes(sizes, world, kind, refusal):
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    env.update({f"PARALLELISM_CONFIG_{name}_SIZE": value for name, value in sizes.items()})
    problems = parallelism_problems(env, world, kind)
    if refusal is None:
        assert problems == []
    else:
        assert len(problems) == 1 and refusal in problems[0], problems


def published_env(name: str, *flags: str) -> tuple[dict[str, str], int]:
    """The variables `accelerate launch --config_file <file> [flags]` gives the script (accelerate's own code)."""
    args = launch_command_parser().parse_args(["--config_file", str(FILES / name), *flags, "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))}, int(args.num_processes)


def _plan(env: dict[str, str], world: int, overrides: tuple[str, ...] = ()):
    cfg = load_config(None, ["model.name=tiny-llama", *overrides])
    plan = plan_engine(cfg, load_strategy(None, env=env), world, torch.device("cpu"), None, env=env)
    return plan, plan.config


def test_trl_fsdp2_sharding_file_runs_with_its_activation_checkpointing():
    env, world = published_env("trl_fsdp2_sharding_2gpus.yaml")
    plan, cfg = _plan(env, world)
    assert (plan.kind, plan.strategy.name, world) == ("fsdp", "fsdp", 2)
    assert cfg.precision == "bf16" and cfg.memory.activation_checkpointing == "full"
    taken = "\n".join(plan.taken)
    assert "memory.activation_checkpointing='full' (from accelerate launch --fsdp_activation_checkpointing true" in taken
    assert plan.launcher_said == (
        "accelerate launch --fsdp_state_dict_type FULL_STATE_DICT: checkpoints are sharded (DCP, resumable at any world size); "
        "`python -m harness.export` writes the whole model",
    )


def test_forward_prefetch_of_trls_fsdp1_file_is_a_hint_said_not_a_refusal():
    env, world = published_env("accelerate_latest_fsdp.yaml", "--fsdp_forward_prefetch", "true")
    plan, _ = _plan(env, world)
    assert plan.kind == "fsdp"
    said = [line for line in plan.launcher_said if "--fsdp_forward_prefetch" in line]
    assert len(said) == 1 and "a speed hint" in said[0], plan.launcher_said


def test_llama_factory_fsdp2_file_honours_the_activation_checkpointing_flag():
    env, world = published_env("llama_factory_fsdp2_config.yaml")
    assert _plan(env, world)[1].memory.activation_checkpointing == "none"
    env, world = published_env("llama_factory_fsdp2_config.yaml", "--fsdp_activation_checkpointing", "true")
    plan, cfg = _plan(env, world)
    assert plan.kind == "fsdp" and cfg.memory.activation_checkpointing == "full"
    contradiction = r"--fsdp_activation_checkpointing true contradicts the run config's memory.activation_checkpointing='none'"
    with pytest.raises(ConfigError, match=contradiction):
        _plan(env, world, ("memory.activation_checkpointing=none",))


def test_a_class_to_wrap_the_model_lacks_is_refused_naming_its_classes(monkeypatch):
    env, world = published_env("accelerate_latest_fsdp.yaml")
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "BertLayer"
    plan, cfg = _plan(env, world)  # nothing else in the file is refused
    with pytest.raises(ConfigError) as exc:
        check_wrap_classes(cfg.model.name, env)
    line = str(exc.value)
    assert "\n" not in line and "the model has no class BertLayer; its classes are" in line
    assert "LlamaDecoderLayer" in line and "LlamaForCausalLM" in line
    check_wrap_classes(cfg.model.name, {**env, "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"})  # the block: accepted
    with pytest.raises(ConfigError, match=r"harness wraps each decoder block \(LlamaDecoderLayer\)"):
        check_wrap_classes(cfg.model.name, {**env, "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaMLP"})


def test_fsdp_settings_harness_does_its_own_way_are_said_and_the_rest_refused():
    base = {"ACCELERATE_USE_FSDP": "true"}
    notes, problems = launcher_settings({**base, "FSDP_VERSION": "1", "FSDP_USE_ORIG_PARAMS": "false"}, 2, "fsdp")
    assert problems == [] and len(notes) == 2 and "harness shards with FSDP2" in notes[0]
    refused = (
        ("FSDP_SHARDING_STRATEGY", "HYBRID_SHARD"),
        ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"),
        ("FSDP_BACKWARD_PREFETCH", "NO_PREFETCH"),
    )
    for var, value in refused:
        notes, problems = launcher_settings({**base, var: value}, 2, "fsdp")
        assert len(problems) == 1 and f"--{var.lower()} {value}" in problems[0], problems
    assert load_strategy(None, env={**base, "FSDP_SHARDING_STRATEGY": "NO_SHARD"}).kind == "ddp"


def test_compile_and_cpu_flags_are_run_config_values():
    problems: list[str] = []
    values = launcher_values({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_USE_CPU": "True"}, problems)
    assert problems == [] and values["memory.compile"][0] == "model" and values["device"][0] == "cpu"
    env = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "True"}
    assert launcher_values(env, problems)["memory.compile"][0] == "block"
    launcher_values({"ACCELERATE_DYNAMO_BACKEND": "EAGER"}, problems)
    assert len(problems) == 1 and "--dynamo_backend eager: harness compiles with inductor only" in problems[0]


def test_sequence_parallel_size_is_the_run_configs_parallel_sequence():
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_SP_SIZE": "2"}
    assert parallelism_problems(env, 2, "fsdp") == []
    assert launcher_values(env, []) == {"parallel.sequence": (2, "accelerate launch --parallelism_config_sp_size 2")}
    notes, problems = launcher_settings(
        env | {"PARALLELISM_CONFIG_SP_BACKEND": "deepspeed", "PARALLELISM_CONFIG_SP_SEQ_LENGTH": "4096"}, 2, "fsdp"
    )
    assert problems == [] and len(notes) == 2 and "harness's own Ulysses" in notes[0]
    _, problems = launcher_settings(env | {"PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "flash_attention_2"}, 2, "fsdp")
    assert len(problems) == 1 and "--parallelism_config_sp_attn_implementation flash_attention_2" in problems[0]
