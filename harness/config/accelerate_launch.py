"""`accelerate launch`: what harness does with each of its flags, each key of its config file,
and each variable it hands the script.

accelerate reads a config file into the same arguments as its flags (a file's `fsdp_config`,
`deepspeed_config`, `parallelism_config`, `dynamo_config`, `fp8_config` and `megatron_lm_config`
keys become the flags of the same names) and passes them to the script only as environment
variables (`accelerate.utils.launch`: `prepare_simple_launcher_cmd_env`, `prepare_multi_gpu_env`,
`prepare_deepspeed_cmd_env`). Each flag has one verdict (`accelerate_table`, docs/strategies.md's accelerate
table; tests/unit/test_accelerate_launch.py keeps both in step with accelerate's own parser);
this module reads the variables: run config values, settings said, refusals.
"""

from __future__ import annotations

from typing import Any

from harness.config.accelerate_table import REFUSED, SAID
from harness.config.vocabulary import PRECISIONS

# Sequence parallelism: the run config key accelerate's `--parallelism_config_sp_size` maps to
# (harness's Ulysses under the torch engines, DeepSpeed's ALST under DeepSpeed; `launcher_values` takes
# the size into it, under the drop-in rule, as `drop_in` takes a DeepSpeed file's `sequence_parallel_size`).
SEQUENCE_PARALLEL_KEY: str | None = "parallel.sequence"

_TRUE = ("true", "1", "yes")


def _on(env: dict[str, str], var: str) -> bool:
    return env.get(var, "").strip().lower() in _TRUE


def _compile_mode(env: dict[str, str], problems: list[str]) -> str | None:
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "NO").strip().upper()
    if backend in ("", "NO"):
        return None
    if backend != "INDUCTOR":
        problems.append(f"accelerate launch --dynamo_backend {backend.lower()}: harness compiles with inductor only; use inductor or no")
        return None
    mode = env.get("ACCELERATE_DYNAMO_MODE", "default")
    if mode not in ("", "default"):
        problems.append(f"accelerate launch --dynamo_mode {mode}: harness compiles in torch.compile's default mode; drop it")
    for var, flag in (
        ("ACCELERATE_DYNAMO_USE_FULLGRAPH", "--dynamo_use_fullgraph"),
        ("ACCELERATE_DYNAMO_USE_DYNAMIC", "--dynamo_use_dynamic"),
    ):
        if _on(env, var):
            problems.append(f"accelerate launch {flag} true: harness compiles with torch.compile's defaults; drop it")
    return "block" if _on(env, "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION") else "model"


def launcher_values(env: dict[str, str], problems: list[str]) -> dict[str, tuple[Any, str]]:
    """The run config keys an `accelerate launch` command set: key -> (value, "accelerate launch --flag X")."""
    out: dict[str, tuple[Any, str]] = {}
    precision = env.get("ACCELERATE_MIXED_PRECISION", "").strip().lower()
    if precision not in ("", "no"):  # "no" is accelerate's default: the flag was not given
        source = f"accelerate launch --mixed_precision {precision}"
        if precision in PRECISIONS:
            out["precision"] = (precision, source)
        else:
            problems.append(f"{source}: harness trains in {', '.join(PRECISIONS)}; use one of them")
    for var, key, flag, kind in (
        ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "grad_accum", "--gradient_accumulation_steps", int),
        ("ACCELERATE_GRADIENT_CLIPPING", "optim.grad_clip", "--gradient_clipping", float),
    ):
        raw = env.get(var, "")
        if raw:
            try:
                out[key] = (kind(raw), f"accelerate launch {flag} {raw}")
            except ValueError:
                problems.append(f"accelerate launch {flag} {raw} is not a number")
    if _on(env, "ACCELERATE_USE_CPU"):
        out["device"] = ("cpu", "accelerate launch --cpu")
    if _on(env, "ACCELERATE_USE_FSDP") and _on(env, "FSDP_ACTIVATION_CHECKPOINTING"):
        out["memory.activation_checkpointing"] = ("full", "accelerate launch --fsdp_activation_checkpointing true")
    sp = env.get("PARALLELISM_CONFIG_SP_SIZE", "1")
    if SEQUENCE_PARALLEL_KEY is not None and _on(env, "ACCELERATE_USE_PARALLELISM_CONFIG") and sp.isdigit() and int(sp) > 1:
        out[SEQUENCE_PARALLEL_KEY] = (int(sp), f"accelerate launch --parallelism_config_sp_size {sp}")
    compile_mode = _compile_mode(env, problems)
    if compile_mode is not None:
        regional = " --dynamo_use_regional_compilation true" if compile_mode == "block" else ""
        out["memory.compile"] = (compile_mode, f"accelerate launch --dynamo_backend inductor{regional}")
    return out


# accelerate's variables for what harness does not do: refused whenever set on
UNSUPPORTED: dict[str, str] = {
    "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "--deepspeed_moe_layer_cls_names (MoE leaf modules): harness builds no MoE leaves",
    "ACCELERATE_CPU_AFFINITY": "--enable_cpu_affinity: harness does not pin ranks to cores",
    "ACCELERATE_DEBUG_MODE": "--debug: harness has no collective shape checks",
    "ACCELERATE_USE_MEGATRON_LM": "--use_megatron_lm: harness does not run Megatron-LM",
}
# FSDP settings: variable -> (the values harness does as asked, what any other value gets, the words for it)
FSDP_VALUES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "FSDP_SHARDING_STRATEGY": (
        ("FULL_SHARD", "1", "SHARD_GRAD_OP", "2", "NO_SHARD", "3"),
        REFUSED,
        "hybrid sharding (HSDP) is not in harness: use FULL_SHARD or SHARD_GRAD_OP",
    ),
    "FSDP_AUTO_WRAP_POLICY": (
        ("TRANSFORMER_BASED_WRAP",),
        REFUSED,
        "harness wraps each decoder block in its own FSDP2 unit (TRANSFORMER_BASED_WRAP)",
    ),
    "FSDP_BACKWARD_PREFETCH": (("BACKWARD_PRE",), REFUSED, "FSDP2 prefetches the next block's gather in backward (BACKWARD_PRE)"),
    "FSDP_FORWARD_PREFETCH": (
        ("FALSE",),
        SAID,
        "a speed hint: FSDP2 already issues the next block's all-gather ahead of its forward (implicit prefetch); "
        "harness adds no explicit one",
    ),
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": (("FALSE",), REFUSED, "checkpointed block inputs stay on the device"),
    "FSDP_VERSION": (("2",), SAID, "harness shards with FSDP2 (torch's fully_shard): the same sharding, its own implementation"),
    "FSDP_STATE_DICT_TYPE": (
        ("SHARDED_STATE_DICT",),
        SAID,
        "checkpoints are sharded (DCP, resumable at any world size); `python -m harness.export` writes the whole model",
    ),
    "FSDP_USE_ORIG_PARAMS": (("TRUE",), SAID, "FSDP2 always keeps the original parameters (no flat parameters)"),
    "FSDP_CPU_RAM_EFFICIENT_LOADING": (("TRUE",), SAID, "harness always loads each rank's part only"),
    "FSDP_SYNC_MODULE_STATES": (("TRUE",), SAID, "every rank fills its part from the same weights"),
}


def _fsdp_settings(env: dict[str, str], notes: list[str], problems: list[str]) -> None:
    for var, (as_asked, otherwise, words) in FSDP_VALUES.items():
        raw = env.get(var, "").strip()
        if not raw or raw.upper() in as_asked:
            continue
        flag = "--" + var.lower()
        if otherwise == REFUSED:
            problems.append(f"accelerate launch {flag} {raw}: {words}; drop it")
        else:
            notes.append(f"accelerate launch {flag} {raw}: {words}")
    if env.get("FSDP_IGNORED_MODULES"):
        problems.append("accelerate launch --fsdp_ignored_modules: harness shards every module; drop it")


def parallelism_problems(env: dict[str, str], world: int, strategy_kind: str) -> list[str]:
    """accelerate's `parallelism_config` sizes against this launch: data-parallel sizes that shard
    over every rank run (dp_shard x dp_replicate = world, replicate 1); hybrid sharding, tensor,
    context and (for now) sequence parallelism are refused, one line each."""
    if not _on(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        return []
    sizes: dict[str, int] = {}
    problems = []
    for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
        raw = env.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1") or "1"
        try:
            sizes[name] = int(raw)
        except ValueError:
            problems.append(f"accelerate launch --parallelism_config_{name}_size {raw} is not a whole number")
            sizes[name] = 1
    flag = "accelerate launch --parallelism_config_{}_size {}"
    if sizes["tp"] > 1:
        problems.append(f"{flag.format('tp', sizes['tp'])} (tensor parallelism): harness trains data-parallel only; use 1")
    if sizes["cp"] > 1:
        problems.append(f"{flag.format('cp', sizes['cp'])} (context parallelism, ring attention) is not in harness; use 1")
    if sizes["sp"] > 1 and SEQUENCE_PARALLEL_KEY is None:
        problems.append(f"{flag.format('sp', sizes['sp'])} (sequence parallelism) is not in harness yet; use 1")
    total = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"] * sizes["cp"] * sizes["sp"]
    if total != world:
        problems.append(
            f"accelerate's parallelism_config sizes multiply to {total} but the launch started {world} processes; make them equal"
        )
    elif sizes["dp_replicate"] > 1 and sizes["dp_shard"] == 1 and strategy_kind != "ddp":
        problems.append(
            f"{flag.format('dp_replicate', sizes['dp_replicate'])} with dp_shard_size 1 keeps the whole model on every rank "
            f"(DDP) but the strategy shards ({strategy_kind}): shard over every rank (dp_shard_size {world}, dp_replicate_size 1)"
        )
    elif sizes["dp_replicate"] > 1 and sizes["dp_shard"] > 1:
        problems.append(
            f"{flag.format('dp_replicate', sizes['dp_replicate'])} with dp_shard_size {sizes['dp_shard']} asks for hybrid "
            f"sharding (HSDP), which harness does not do: shard over every rank (dp_shard_size {world}, dp_replicate_size 1)"
        )
    elif sizes["dp_shard"] > 1 and strategy_kind == "ddp":
        problems.append(f"{flag.format('dp_shard', sizes['dp_shard'])} shards the model, but the strategy is DDP: launch with --use_fsdp")
    return problems


def launcher_settings(env: dict[str, str], world: int, strategy_kind: str) -> tuple[list[str], list[str]]:
    """What the launch asks that is not a run config value: (notes: said in the log, problems: one
    line per refusal). The strategy flags are read by `strategies.load_strategy`, the wrapped class
    by `wrap_class_problem` (pre-flight, with the model)."""
    notes: list[str] = []
    problems: list[str] = []
    for var, what in UNSUPPORTED.items():
        if env.get(var, "").strip().lower() not in ("", "0", "false", "none"):
            problems.append(f"accelerate launch {what}; remove it")
    if _on(env, "ACCELERATE_USE_FSDP"):
        _fsdp_settings(env, notes, problems)
    problems += parallelism_problems(env, world, strategy_kind)
    _sequence_settings(env, notes, problems)
    return notes, problems


def _sequence_settings(env: dict[str, str], notes: list[str], problems: list[str]) -> None:
    """accelerate's other `sp_*` keys, read when its sequence-parallel size is above 1."""
    sp = env.get("PARALLELISM_CONFIG_SP_SIZE", "1").strip()
    if not (_on(env, "ACCELERATE_USE_PARALLELISM_CONFIG") and sp.isdigit() and int(sp) > 1):
        return
    backend = env.get("PARALLELISM_CONFIG_SP_BACKEND", "").strip()
    if backend:
        notes.append(f"accelerate launch --parallelism_config_sp_backend {backend}: runs as harness's own Ulysses (all-to-all around sdpa)")
    for var in ("PARALLELISM_CONFIG_SP_SEQ_LENGTH", "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE"):
        if env.get(var, "").strip():
            notes.append(f"accelerate launch --{var.lower()} {env[var].strip()}: harness splits every block of data.seq_len")
    attn = env.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "").strip()
    if attn and attn.lower() != "sdpa":
        problems.append(
            f"accelerate launch --parallelism_config_sp_attn_implementation {attn}: harness's sequence parallelism runs sdpa; use sdpa"
        )


def wrap_class_problem(env: dict[str, str], model_classes: set[str], block_classes: set[str]) -> str | None:
    """`--fsdp_transformer_layer_cls_to_wrap` against the model: accelerate refuses a class the model
    lacks; harness wraps the decoder blocks, so the names must be exactly those."""
    raw = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "") if _on(env, "ACCELERATE_USE_FSDP") else ""
    named = {name.strip() for name in raw.split(",") if name.strip()}
    if not named:
        return None
    flag = f"accelerate launch --fsdp_transformer_layer_cls_to_wrap {raw}"
    missing = sorted(named - model_classes)
    if missing:
        return f"{flag}: the model has no class {', '.join(missing)}; its classes are {', '.join(sorted(model_classes))}"
    if named != block_classes:
        return f"{flag}: harness wraps each decoder block ({', '.join(sorted(block_classes))}) in its own FSDP2 unit; name that or drop it"
    return None
