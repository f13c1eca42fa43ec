"""Strategy files: which distribution engine shards what, read from one JSON file.

DeepSpeed files are DeepSpeed's own schema, so a user's existing `ds_config.json` drops in;
`"auto"` values are filled from the run config, and a number that contradicts the run
config is an error naming both. FSDP2 and DDP files use a small schema of ours:

    {"kind": "fsdp", "reshard_after_forward": true, "offload": false}
    {"kind": "ddp"}

`reshard_after_forward: false` keeps parameters gathered between forward and backward
(ZeRO-2-like); `offload: true` is FSDP2's CPUOffloadPolicy (needs an accelerator).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

from harness.config.schema import RunConfig
from harness.errors import ConfigError, did_you_mean

DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_configs")  # package data: found from a wheel too
OUR_KEYS = {"kind", "reshard_after_forward", "offload", "reduce_dtype", "comment"}


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
            "fsdp", name, path, zero_stage=3 if reshard else 2, reshard_after_forward=reshard,
            offload_optimizer="cpu" if offload else "none", offload_params="cpu" if offload else "none",
            reduce_dtype=reduce_dtype, raw=raw,
        )
    raise ConfigError(f"{path}: kind must be 'ddp' or 'fsdp' (or omit it for a DeepSpeed config), got {kind!r}")


def _deepspeed_strategy(name: str, path: str, raw: dict[str, Any]) -> Strategy:
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{path}: zero_optimization must be an object")
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


# ------------------------------------------------------------------ DeepSpeed "auto" filling


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def _settle(ds: dict[str, Any], key: str, ours: Any, ours_name: str, path: str) -> None:
    """Fill an "auto" (or absent) value from the run config; a different number is an error."""
    current = ds.get(key, "auto")
    if _is_auto(current):
        ds[key] = ours
    elif current != ours:
        raise ConfigError(f"{path}: {key}={current!r} contradicts the run config's {ours_name}={ours!r}")


def resolve_deepspeed_config(strategy: Strategy, cfg: RunConfig, world_size: int, hidden_size: int | None = None) -> dict[str, Any]:
    """DeepSpeed's config dict with every "auto" filled from the run config."""
    path = strategy.path
    ds = copy.deepcopy(strategy.raw)
    _settle(ds, "train_micro_batch_size_per_gpu", cfg.micro_batch_size, "micro_batch_size", path)
    _settle(ds, "gradient_accumulation_steps", cfg.grad_accum, "grad_accum", path)
    _settle(ds, "train_batch_size", cfg.micro_batch_size * cfg.grad_accum * world_size,
            f"micro_batch_size*grad_accum*world ({cfg.micro_batch_size}*{cfg.grad_accum}*{world_size})", path)
    clip = cfg.optim.grad_clip
    if _is_auto(ds.get("gradient_clipping", "auto")):
        ds["gradient_clipping"] = clip
    elif float(ds["gradient_clipping"]) != float(clip):
        raise ConfigError(f"{path}: gradient_clipping={ds['gradient_clipping']!r} contradicts the run config's optim.grad_clip={clip!r}")
    for section, want in (("bf16", cfg.precision == "bf16"), ("fp16", cfg.precision == "fp16")):
        block = ds.setdefault(section, {})
        enabled = block.get("enabled", "auto")
        if _is_auto(enabled):
            block["enabled"] = want
        elif bool(enabled) != want:
            raise ConfigError(f"{path}: {section}.enabled={enabled!r} contradicts the run config's precision={cfg.precision!r}")
    if "optimizer" in ds:
        opt = ds["optimizer"]
        if _is_auto(opt.get("type", "auto")):
            opt["type"] = "AdamW" if cfg.optim.name in ("adamw", "adam") else "SGD"
        params = opt.setdefault("params", {})
        fills = {"lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay, "betas": list(cfg.optim.betas), "eps": cfg.optim.eps}
        for key, value in fills.items():
            if _is_auto(params.get(key, "auto")):
                params[key] = value
    if "scheduler" in ds and _is_auto(ds["scheduler"].get("type", "")):
        # Our own schedule drives the LR (same on every strategy); DeepSpeed gets no scheduler.
        del ds["scheduler"]
    zero = ds.get("zero_optimization", {})
    size_autos = {
        "reduce_bucket_size": (hidden_size or 0) ** 2,
        "allgather_bucket_size": (hidden_size or 0) ** 2,
        "stage3_prefetch_bucket_size": int(0.9 * (hidden_size or 0) ** 2),
        "stage3_param_persistence_threshold": 10 * (hidden_size or 0),
    }
    for key, value in size_autos.items():
        if _is_auto(zero.get(key)):
            if not hidden_size:
                raise ConfigError(f"{path}: zero_optimization.{key} is 'auto' but the model's hidden size is unknown; give a number")
            zero[key] = value
    for off in ("offload_optimizer", "offload_param"):
        block = zero.get(off) or {}
        if block.get("device") == "nvme":
            nvme = block.get("nvme_path")
            if not nvme or not os.path.isdir(nvme) or not os.access(nvme, os.W_OK):
                raise ConfigError(f"{path}: zero_optimization.{off}.nvme_path={nvme!r} is missing or not writable; "
                                  "set it to a writable NVMe directory")
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


