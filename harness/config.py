"""The run config: typed dataclasses, loaded from YAML/JSON, overridden by `key=value`.

Every section is a dataclass so that an unknown key is an error naming the closest valid
key, instead of a silently ignored typo.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A config problem the user can fix; its message is one actionable line."""


@dataclass
class ModelConfig:
    name: str = "tiny-llama"  # preset name, local path or hub id
    seed: int = 0  # random init seed for presets
    max_seq_len: int | None = None  # defaults to the model's max positions


@dataclass
class DataConfig:
    source: str = "embedded"  # "embedded", a hub dataset name, or a local file/dir
    text_field: str = "text"
    seq_len: int = 128
    eval_fraction: float = 0.05
    calib_fraction: float = 0.05
    max_tokens: int | None = 400_000  # cap on the tokenized corpus (keeps CPU runs fast)
    tokenizer: str | None = None  # path; default: the model's, else a locally trained BPE
    vocab_size: int = 2048  # for the locally trained BPE tokenizer
    seed: int = 1234
    cache_dir: str | None = None  # where tokenizers/tokenized data are cached


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class MemoryConfig:
    """Memory techniques (issue: memory techniques). All off by default."""

    activation_checkpointing: str = "none"  # none | full | selective | op
    ac_every: int = 2  # selective: checkpoint every k-th block
    activation_offload: bool = False
    compile: str = "none"  # none | block | model
    activation_memory_budget: float | None = None  # in [0, 1]; implies compile
    optimizer_in_backward: bool = False
    loss_chunk_size: int = 0  # 0: plain fp32 cross-entropy; >0: chunked over the sequence
    track: bool = True  # per-step peak memory by category
    track_every: int = 1  # split peaks into categories every k-th step (the split costs ~2x a step on CPU)
    snapshot: bool = False  # memory snapshot (GPU pickle / CPU per-module report)
    layer_hooks: bool = False  # per-block memory after forward (debug)


@dataclass
class LoggingConfig:
    log_every: int = 1
    wandb: bool = True  # rank 0 only; offline without an API key
    wandb_project: str = "harness"
    run_name: str | None = None
    progress: bool = True
    plots: bool = True
    peak_flops: float | None = None  # per device, overrides the GPU table (needed for MFU on CPU)


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only at the end (if save_final)
    save_final: bool = False
    keep: int = 2
    resume: str = "none"  # none | auto | <path>
    overwrite: bool = False
    on_nonfinite: str = "skip"  # skip | stop
    export_hf: bool = False


@dataclass
class PruneConfig:
    method: str = "none"  # none | magnitude | wanda | sparsegpt | gradprobe
    base: str = "wanda"  # gradprobe's candidate strategy: magnitude | wanda
    sparsity: float = 0.5
    pattern: str = "unstructured"  # unstructured | N:M, e.g. 2:4
    calib_samples: int = 16
    calib_seed: int = 0
    group_size: int = 0  # K layers probed together; 0 = chosen from memory
    threshold: float = 0.0
    reduction: float = 0.1
    exact_target: bool = True
    scope: str = "per_matrix"  # per_matrix | global
    targets: str = "decoder_linears"  # decoder_linears | all_linears
    pool: float = 0.25  # exact-target GradProbe: probe (1 + pool) x target candidates
    sequential: bool | None = None  # apply each group's mask before probing the next (None: SparseGPT only)
    schedule: list[float] | None = None  # iterative targets, e.g. [0.3, 0.4, 0.5]
    max_metric_increase: float = 0.1  # iterative schedule stops when eval loss rises more than this
    stat_dtype: str = "bf16"  # storage of gradient statistics: bf16 | fp16
    finetune_steps: int = 0  # training steps after pruning (masks enforced)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    strategy: str | None = None  # a name in ds_configs/ or a JSON path; None: from the launcher, else ddp
    precision: str = "fp32"  # fp32 | bf16 | fp16
    micro_batch_size: int = 4
    grad_accum: int = 1
    global_batch_size: int | None = None  # if set: must equal micro * accum * world
    steps: int = 50
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    seed: int = 0
    output_dir: str = "runs/default"
    device: str = "auto"  # auto | cpu | cuda


# ----------------------------------------------------------------------------- loading


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Convert a YAML/JSON/CLI value to the field's declared type, or raise ConfigError."""
    origin = get_origin(typ)
    args = get_args(typ)
    if origin is type(int | None) or (origin is not None and str(origin) == "typing.Union"):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], where)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], where) for v in value]
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args))
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            number = float(value) if typ is float else value
            if typ is int:
                as_float = float(value)
                if as_float != int(as_float):
                    raise ValueError
                number = int(as_float)
            return number
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}") from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}'{_suggest(key, names)}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, typ, f"{prefix}{key}")
    return cls(**kwargs)


def all_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config (for suggestions and the README reference)."""
    keys = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += all_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _yaml_loader():
    """SafeLoader without YAML 1.1's base-60 integers, so `pattern: 2:4` stays the string '2:4'."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:int"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:int",
        re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
        list("-+0123456789"),
    )
    return Loader


def parse_yaml(text: str) -> Any:
    import yaml

    return yaml.load(text, Loader=_yaml_loader())


def read_config_file(path: str) -> dict[str, Any]:
    """Parse a YAML or JSON config file; syntax errors name the line."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' not found")
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    else:
        import yaml

        try:
            data = parse_yaml(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" at line {mark.line + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{path}: invalid YAML{line}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides to a nested dict (values parsed as YAML scalars)."""
    import yaml

    valid = all_keys()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        if key not in valid:
            raise ConfigError(f"unknown config key '{key}'{_suggest(key, valid)}")
        try:
            value = parse_yaml(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        node[parts[-1]] = value
    return data


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    data = read_config_file(path) if path else {}
    data = apply_overrides(data, overrides or [])
    cfg = _build(RunConfig, data)
    check_values(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def check_values(cfg: RunConfig) -> None:
    """Checks on single values; cross-checks that need the strategy or model live elsewhere."""
    choices = {
        "precision": (cfg.precision, ("fp32", "bf16", "fp16")),
        "memory.activation_checkpointing": (cfg.memory.activation_checkpointing, ("none", "full", "selective", "op")),
        "memory.compile": (cfg.memory.compile, ("none", "block", "model")),
        "optim.schedule": (cfg.optim.schedule, ("cosine", "linear", "constant")),
        "optim.name": (cfg.optim.name, ("adamw", "adam", "sgd")),
        "checkpoint.on_nonfinite": (cfg.checkpoint.on_nonfinite, ("skip", "stop")),
        "prune.method": (cfg.prune.method, ("none", "magnitude", "wanda", "sparsegpt", "gradprobe")),
        "prune.base": (cfg.prune.base, ("magnitude", "wanda")),
        "prune.scope": (cfg.prune.scope, ("per_matrix", "global")),
        "prune.targets": (cfg.prune.targets, ("decoder_linears", "all_linears")),
        "prune.stat_dtype": (cfg.prune.stat_dtype, ("bf16", "fp16")),
        "device": (cfg.device, ("auto", "cpu", "cuda")),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}{_suggest(str(value), list(allowed))}")
    positive = {
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum": cfg.grad_accum,
        "steps": cfg.steps,
        "data.seq_len": cfg.data.seq_len,
        "eval_batches": cfg.eval_batches,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    budget = cfg.memory.activation_memory_budget
    if budget is not None and not 0.0 <= budget <= 1.0:
        raise ConfigError(f"memory.activation_memory_budget={budget} must be in [0, 1]")
    if not 0.0 <= cfg.prune.sparsity < 1.0:
        raise ConfigError(f"prune.sparsity={cfg.prune.sparsity} must be in [0, 1)")
    if cfg.prune.pattern != "unstructured":
        try:
            n, m = (int(x) for x in cfg.prune.pattern.split(":"))
        except ValueError:
            raise ConfigError(f"prune.pattern={cfg.prune.pattern!r} must be 'unstructured' or N:M like 2:4") from None
        if not 0 < n < m:
            raise ConfigError(f"prune.pattern={cfg.prune.pattern}: N:M needs 0 < N < M")
        if cfg.prune.method != "none" and abs(cfg.prune.sparsity - (m - n) / m) > 1e-9:
            raise ConfigError(f"prune.pattern={cfg.prune.pattern} prunes {(m - n) / m:g} of each group but prune.sparsity={cfg.prune.sparsity}; set prune.sparsity={(m - n) / m:g}")
    for key, frac in (("data.eval_fraction", cfg.data.eval_fraction), ("data.calib_fraction", cfg.data.calib_fraction)):
        if not 0.0 < frac < 0.5:
            raise ConfigError(f"{key}={frac} must be in (0, 0.5)")
