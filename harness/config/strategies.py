"""Strategy files: which distribution engine shards what, read from one JSON file.

DeepSpeed files are DeepSpeed's own schema, so a user's existing `ds_config.json` drops in
and is honoured as written: `"auto"` (or absent) values are filled from the run config and
each fill is reported, a number that contradicts the run config is an error naming both, a
scheduler the file names is the one DeepSpeed uses, and a key DeepSpeed does not read is an
error naming the closest one it does. FSDP2 and DDP files use a small schema of ours:

    {"kind": "fsdp", "reshard_after_forward": true, "offload": false}
    {"kind": "ddp"}

`reshard_after_forward: false` keeps parameters gathered between forward and backward
(ZeRO-2-like); `offload: true` is FSDP2's CPUOffloadPolicy (needs an accelerator).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

from harness.config.schema import RunConfig
from harness.errors import ConfigError, did_you_mean

DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_configs")  # package data: found from a wheel too
OUR_KEYS = {"kind", "reshard_after_forward", "offload", "reduce_dtype", "comment"}
OUR_DEEPSPEED_KEYS = {"comment"}  # harness's own keys a DeepSpeed file may carry (DeepSpeed ignores them)


@dataclass
class Strategy:
    """A resolved strategy: the engine to use and what it shards or offloads."""

    kind: str  # "ddp" | "fsdp" | "deepspeed"
    name: str
    path: str
    zero_stage: int = 0  # ZeRO stage equivalent: ddp 0, fsdp 3 (or 2 without reshard), deepspeed 0-3
    reshard_after_forward: bool = True
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_params: str = "none"
    reduce_dtype: str = "fp32"
    raw: dict[str, Any] = field(default_factory=dict)  # the file as written

    @property
    def needs_process_group(self) -> bool:
        """DeepSpeed and FSDP2 run under a process group even alone (a group of one), so one
        process trains exactly as each rank of many does; DDP alone is the bare module."""
        return self.kind in ("deepspeed", "fsdp")

    @property
    def shards_params(self) -> bool:
        return (self.kind == "fsdp") or (self.kind == "deepspeed" and self.zero_stage == 3)


def strategy_path(name_or_path: str) -> str:
    """A name like `zero2` resolves to ds_configs/zero2.json; anything else is a path."""
    if os.path.isfile(name_or_path):
        return name_or_path
    candidate = os.path.join(DS_CONFIG_DIR, name_or_path if name_or_path.endswith(".json") else name_or_path + ".json")
    if os.path.isfile(candidate):
        return candidate
    shipped = sorted(f[:-5] for f in os.listdir(DS_CONFIG_DIR) if f.endswith(".json")) if os.path.isdir(DS_CONFIG_DIR) else []
    hint = did_you_mean(os.path.basename(name_or_path).removesuffix(".json"), shipped, cutoff=0.6) or f" (shipped: {', '.join(shipped)})"
    raise ConfigError(f"strategy '{name_or_path}' is neither a file nor a name in ds_configs/{hint}")


def strategy_from_launcher(env: dict[str, str] | None = None) -> str | None:
    """The strategy an `accelerate launch --use_deepspeed/--use_fsdp` command asked for.

    accelerate passes its plugin choice to the script only as environment variables; we
    honour them (so accelerate users keep their habits) but apply the strategy ourselves,
    because on CPU accelerate silently drops FSDP and miscounts DeepSpeed ranks.
    """
    env = dict(os.environ) if env is None else env
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
            return env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        offload = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
        if offload not in ("none", ""):
            return "zero3_offload" if stage == "3" else "zero2_offload"
        return f"zero{stage}"
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        if env.get("FSDP_OFFLOAD_PARAMS", "").lower() == "true":
            return "fsdp_offload"
        sharding = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
        reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
        return "fsdp_grad_op" if sharding in ("SHARD_GRAD_OP", "2") or reshard == "false" else "fsdp"
    return None


def read_strategy_file(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a strategy file must be a JSON object")
    return data


def load_strategy(name_or_path: str | None, env: dict[str, str] | None = None) -> Strategy:
    """The run config's strategy, else the one `accelerate launch` flags asked for, else DDP."""
    launcher = strategy_from_launcher(env)
    if name_or_path and launcher and os.path.realpath(strategy_path(name_or_path)) != os.path.realpath(strategy_path(launcher)):
        raise ConfigError(
            f"the run config says strategy={name_or_path!r} but accelerate launch asked for {launcher!r} "
            "(--use_deepspeed/--use_fsdp); drop one of the two"
        )
    name_or_path = name_or_path or launcher or "ddp"
    path = strategy_path(name_or_path)
    raw = read_strategy_file(path)
    name = os.path.basename(path).removesuffix(".json")
    kind = raw.get("kind")
    if kind is None:
        return _deepspeed_strategy(name, path, raw)
    unknown = set(raw) - OUR_KEYS
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"{path}: unknown key '{key}'{did_you_mean(key, sorted(OUR_KEYS), cutoff=0.6)}")
    if kind == "ddp":
        return Strategy("ddp", name, path, zero_stage=0, raw=raw)
    if kind == "fsdp":
        reshard = raw.get("reshard_after_forward", True)
        offload = raw.get("offload", False)
        if not isinstance(reshard, bool) or not isinstance(offload, bool):
            raise ConfigError(f"{path}: 'reshard_after_forward' and 'offload' must be true or false")
        reduce_dtype = raw.get("reduce_dtype", "fp32")
        if reduce_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"{path}: reduce_dtype must be fp32 or bf16, got {reduce_dtype!r}")
        return Strategy(
            "fsdp",
            name,
            path,
            zero_stage=3 if reshard else 2,
            reshard_after_forward=reshard,
            offload_optimizer="cpu" if offload else "none",
            offload_params="cpu" if offload else "none",
            reduce_dtype=reduce_dtype,
            raw=raw,
        )
    raise ConfigError(f"{path}: kind must be 'ddp' or 'fsdp' (or omit it for a DeepSpeed config), got {kind!r}")


def _deepspeed_strategy(name: str, path: str, raw: dict[str, Any]) -> Strategy:
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{path}: zero_optimization must be an object")
    check_deepspeed_keys(raw, path)
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    off_opt = (zero.get("offload_optimizer") or {}).get("device", "none") or "none"
    off_par = (zero.get("offload_param") or {}).get("device", "none") or "none"
    for what, device in (("offload_optimizer", off_opt), ("offload_param", off_par)):
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{path}: zero_optimization.{what}.device must be none, cpu or nvme, got {device!r}")
    if off_par != "none" and stage != 3:
        raise ConfigError(f"{path}: offload_param needs zero_optimization.stage 3 (got stage {stage})")
    if off_opt != "none" and stage == 0:
        raise ConfigError(f"{path}: offload_optimizer needs zero_optimization.stage 1, 2 or 3 (got stage 0)")
    return Strategy("deepspeed", name, path, zero_stage=stage, offload_optimizer=off_opt, offload_params=off_par, raw=raw)


# ------------------------------------------------------------------ DeepSpeed's key schema


@functools.cache
def deepspeed_top_level_keys() -> frozenset[str]:
    """Every top-level key DeepSpeed's config parser reads, taken from DeepSpeed itself.

    Its parser (`DeepSpeedConfig._initialize_params`, its warning checks, and the list of
    removed keys it rejects with its own message) runs once on an empty dict that notes each
    key looked up: exactly the keys this DeepSpeed version reads, with no list of ours to go
    stale. Should a future parser not run on an empty dict, every string constant its module
    defines is taken instead (broader, never narrower). DeepSpeed is imported here, not at
    module top: importing it probes accelerators and logs.
    """
    import deepspeed.runtime.config as ds_config

    seen: set[str] = set()

    class Recorder(dict):
        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __bool__(self):  # `if param_dict and KEY in param_dict.keys()` still looks the key up
            return True

        def keys(self):
            return self

    probe = object.__new__(ds_config.DeepSpeedConfig)
    probe.global_rank, probe.world_size = 0, 1
    probe._param_dict = Recorder()
    try:
        seen.update(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))  # DeepSpeed rejects these itself, by name
        probe._initialize_params(probe._param_dict)
        probe._do_warning_check()
    except Exception:
        seen.update(v for k, v in vars(ds_config).items() if k.isupper() and isinstance(v, str) and v.isidentifier())
    return frozenset(seen)


def _model_fields(model: Any) -> dict[str, Any]:
    """A DeepSpeed pydantic config model's keys (field names and aliases) → the model of a nested block, or None."""
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        nested = _nested_model(info.annotation)
        for key in (name, info.alias, info.validation_alias):
            if isinstance(key, str):
                fields[key] = nested
    return fields


def _nested_model(annotation: Any) -> Any:
    """The pydantic model inside an annotation like `Optional[DeepSpeedZeroOffloadParamConfig]`, or None."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


@functools.cache
def _deepspeed_zero_schema() -> tuple[Any, frozenset[str]]:
    """DeepSpeed's zero_optimization model and the ZeRO keys it rejects itself as removed."""
    import deepspeed.runtime.config as ds_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig, frozenset(getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}))


def _unknown_key(path: str, where: str, key: str, known: set[str]) -> ConfigError:
    hint = did_you_mean(key, sorted(known), cutoff=0.6) or " (DeepSpeed reads no such key; see https://www.deepspeed.ai/docs/config-json/)"
    return ConfigError(f"{path}: unknown DeepSpeed key '{where}{key}'{hint}")


def _check_model_keys(block: dict[str, Any], model: Any, also: frozenset[str], path: str, where: str) -> None:
    """Every key of `block` must be one `model` (a DeepSpeed config model) declares; nested blocks likewise."""
    if model.model_config.get("extra") == "allow":  # a block DeepSpeed passes through as it is
        return
    fields = _model_fields(model)
    for key, value in block.items():
        if key not in fields and key not in also:
            raise _unknown_key(path, where, key, set(fields) | also)
        if isinstance(value, dict) and fields.get(key) is not None:
            _check_model_keys(value, fields[key], frozenset(), path, f"{where}{key}.")


def check_deepspeed_keys(raw: dict[str, Any], path: str) -> None:
    """A key DeepSpeed does not read is a ConfigError naming the closest one it does: a misspelt
    `zero_optimisation` would otherwise train silently at ZeRO stage 0. Checked: the top level,
    and zero_optimization with its offload_* (and other nested) blocks, against DeepSpeed's own schema."""
    top = set(deepspeed_top_level_keys()) | OUR_DEEPSPEED_KEYS
    for key in raw:
        if key not in top:
            raise _unknown_key(path, "", key, top)
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        model, removed = _deepspeed_zero_schema()
        _check_model_keys(zero, model, removed, path, "zero_optimization.")


# ------------------------------------------------------------------ DeepSpeed "auto" filling


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def _same(current: Any, ours: Any) -> bool:
    """A value in the file equals the run config's (numbers compared as floats, lists element-wise)."""
    if isinstance(ours, (list, tuple)):
        return isinstance(current, (list, tuple)) and len(current) == len(ours) and all(_same(a, b) for a, b in zip(current, ours))
    return isinstance(current, (int, float)) and not isinstance(current, bool) and float(current) == float(ours)


def _note(filled: list[str] | None, key: str, value: Any, source: str) -> None:
    if filled is not None:
        filled.append(f"{key}={value} (from {source})")


def _settle(ds: dict[str, Any], key: str, ours: Any, ours_name: str, path: str, filled: list[str] | None = None, where: str = "") -> None:
    """Fill an "auto" (or absent) value from the run config; a different number is an error."""
    current = ds.get(key, "auto")
    if _is_auto(current):
        ds[key] = ours
        _note(filled, f"{where}{key}", ours, ours_name)
    elif not _same(current, ours):
        raise ConfigError(f"{path}: {where}{key}={current!r} contradicts the run config's {ours_name}={ours!r}")


def _optimizer_kind(type_name: Any, params: dict[str, Any]) -> str:
    """What DeepSpeed runs for an optimizer type, in optim.name's words (its "Adam" is AdamW unless adam_w_mode is false)."""
    name = str(type_name).lower()
    if name == "adam":
        return "adam" if params.get("adam_w_mode", True) is False else "adamw"
    return name


def _resolve_optimizer(ds: dict[str, Any], cfg: RunConfig, path: str, filled: list[str] | None) -> None:
    """The file's optimizer must be the run config's: "auto"/absent values are filled, any other is compared."""
    opt, o = ds["optimizer"], cfg.optim
    if not isinstance(opt, dict) or not isinstance(opt.setdefault("params", {}), dict):
        raise ConfigError(f"{path}: optimizer and optimizer.params must be objects")
    params = opt["params"]
    if _is_auto(opt.get("type", "auto")):
        opt["type"] = {"adamw": "AdamW", "adam": "Adam"}.get(o.name, "SGD")
        _note(filled, "optimizer.type", opt["type"], "optim.name")
        if o.name == "adam" and _is_auto(params.get("adam_w_mode", "auto")):
            params["adam_w_mode"] = False  # DeepSpeed's "Adam" is AdamW unless told otherwise
            _note(filled, "optimizer.params.adam_w_mode", False, "optim.name=adam")
    kind = _optimizer_kind(opt["type"], params)
    if kind != o.name:
        why = " (DeepSpeed runs 'Adam' as AdamW unless optimizer.params.adam_w_mode is false)" if str(opt["type"]).lower() == "adam" else ""
        raise ConfigError(f"{path}: optimizer.type={opt['type']!r} contradicts the run config's optim.name={o.name!r}{why}")
    ours: dict[str, tuple[Any, str]] = {"lr": (o.lr, "optim.lr"), "weight_decay": (o.weight_decay, "optim.weight_decay")}
    if kind in ("adam", "adamw"):  # torch's SGD takes neither
        ours.update(betas=(list(o.betas), "optim.betas"), eps=(o.eps, "optim.eps"))
    for key, (value, name) in ours.items():
        _settle(params, key, value, name, path, filled, where="optimizer.params.")


def _resolve_scheduler(ds: dict[str, Any], cfg: RunConfig, path: str, filled: list[str] | None) -> None:
    """A scheduler the file names is DeepSpeed's to run, as written (its "auto" params filled); a
    "type": "auto" one, or none, means harness's own schedule drives the LR (DeepSpeed gets none)."""
    sched = ds.get("scheduler")
    if sched is None or (isinstance(sched, dict) and _is_auto(sched.get("type"))):
        ds.pop("scheduler", None)
        o = cfg.optim
        if filled is not None:
            filled.append(
                f"scheduler=harness's {o.schedule} schedule (from optim.schedule, optim.warmup_steps={o.warmup_steps}, "
                f"optim.min_lr_ratio={o.min_lr_ratio})"
            )
        return
    if not isinstance(sched, dict) or not isinstance(sched.get("type"), str) or not isinstance(sched.get("params", {}), dict):
        raise ConfigError(
            f"{path}: scheduler needs a 'type' (a DeepSpeed scheduler such as WarmupLR, or \"auto\" for harness's "
            "schedule) and 'params' as an object"
        )
    o = cfg.optim
    autos = {  # DeepSpeed's (and HF's) "auto" scheduler params, from the run config
        "warmup_num_steps": (o.warmup_steps, "optim.warmup_steps"),
        "total_num_steps": (cfg.steps, "steps"),
        "warmup_max_lr": (o.lr, "optim.lr"),
        "warmup_min_lr": (o.lr * o.min_lr_ratio, "optim.lr*optim.min_lr_ratio"),
        "cos_min_ratio": (o.min_lr_ratio, "optim.min_lr_ratio"),
    }
    params = sched.get("params", {})
    for key, value in params.items():
        if _is_auto(value) and key in autos:
            params[key] = autos[key][0]
            _note(filled, f"scheduler.params.{key}", autos[key][0], autos[key][1])
    # any other "auto" is named by the leftover check in resolve_deepspeed_config


def resolve_deepspeed_config(
    strategy: Strategy, cfg: RunConfig, world_size: int, hidden_size: int | None = None, filled: list[str] | None = None
) -> dict[str, Any]:
    """DeepSpeed's config dict with every "auto" (or absent value harness owns) filled from the run config.

    The file is otherwise honoured as written: a value that contradicts the run config is a
    ConfigError naming both, and a scheduler the file names stays (see `_resolve_scheduler`).
    `filled`, when given, collects one human-readable entry per value harness filled in.
    """
    path = strategy.path
    ds = copy.deepcopy(strategy.raw)
    _settle(ds, "train_micro_batch_size_per_gpu", cfg.micro_batch_size, "micro_batch_size", path, filled)
    _settle(ds, "gradient_accumulation_steps", cfg.grad_accum, "grad_accum", path, filled)
    _settle(
        ds,
        "train_batch_size",
        cfg.micro_batch_size * cfg.grad_accum * world_size,
        f"micro_batch_size*grad_accum*world ({cfg.micro_batch_size}*{cfg.grad_accum}*{world_size})",
        path,
        filled,
    )
    _settle(ds, "gradient_clipping", cfg.optim.grad_clip, "optim.grad_clip", path, filled)
    for section, want in (("bf16", cfg.precision == "bf16"), ("fp16", cfg.precision == "fp16")):
        block = ds.setdefault(section, {})
        enabled = block.get("enabled", "auto")
        if _is_auto(enabled):
            block["enabled"] = want
            _note(filled, f"{section}.enabled", want, f"precision={cfg.precision}")
        elif bool(enabled) != want:
            raise ConfigError(f"{path}: {section}.enabled={enabled!r} contradicts the run config's precision={cfg.precision!r}")
    if "optimizer" in ds:
        _resolve_optimizer(ds, cfg, path, filled)
    _resolve_scheduler(ds, cfg, path, filled)
    zero = ds.get("zero_optimization", {})
    size_autos = {
        "reduce_bucket_size": (hidden_size or 0) ** 2,
        "allgather_bucket_size": (hidden_size or 0) ** 2,
        "stage3_prefetch_bucket_size": int(0.9 * (hidden_size or 0) ** 2),
        "stage3_param_persistence_threshold": 10 * (hidden_size or 0),
        # About two decoder blocks (12·h² parameters each): DeepSpeed keeps a gathered parameter
        # whose next use lies within this many parameters (and prefetches up to it). Its default
        # 1e9 exceeds a whole forward plus backward of models up to ~500M parameters, so from the
        # second step on nothing is released and every rank holds the whole model; two blocks
        # release like FSDP2 (the current block and the next one gathered).
        "stage3_max_live_parameters": 24 * (hidden_size or 0) ** 2,
        "stage3_max_reuse_distance": 24 * (hidden_size or 0) ** 2,
    }
    for key, value in size_autos.items():
        if _is_auto(zero.get(key)):
            if not hidden_size:
                raise ConfigError(f"{path}: zero_optimization.{key} is 'auto' but the model's hidden size is unknown; give a number")
            zero[key] = value
            _note(filled, f"zero_optimization.{key}", value, f"the model's hidden size {hidden_size}")
    for off in ("offload_optimizer", "offload_param"):
        block = zero.get(off) or {}
        if block.get("device") == "nvme":
            nvme = block.get("nvme_path")
            if not nvme or not os.path.isdir(nvme) or not os.access(nvme, os.W_OK):
                raise ConfigError(
                    f"{path}: zero_optimization.{off}.nvme_path={nvme!r} is missing or not writable; set it to a writable NVMe directory"
                )
    leftover = _find_auto(ds)
    if leftover:
        raise ConfigError(f"{path}: '{leftover}' is 'auto' but harness cannot fill it; give a number")
    return ds


def _find_auto(node: Any, prefix: str = "") -> str | None:
    if isinstance(node, dict):
        for key, value in node.items():
            found = _find_auto(value, f"{prefix}{key}.")
            if found:
                return found
    elif _is_auto(node):
        return prefix.rstrip(".")
    return None
