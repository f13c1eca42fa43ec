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

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from harness.config.deepspeed_keys import check_deepspeed_keys
from harness.errors import ConfigError, did_you_mean

DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_configs")  # package data: found from a wheel too
OUR_KEYS = {"kind", "reshard_after_forward", "offload", "reduce_dtype", "comment"}

# The one vocabulary for "which engine": a strategy file names ddp, fsdp or deepspeed; a DDP
# strategy run as one process is the bare module, "single". Strategy, Engine, the planner and
# checkpoint metadata all use these words, and `engine_kind` is the one rule between them.
EngineKind = Literal["single", "ddp", "fsdp", "deepspeed"]
ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)
# The on-disk format each kind's checkpoints are written in (`Engine.checkpoint_format`, metadata `engine`).
CheckpointFormat = Literal["torch", "deepspeed"]


def engine_kind(strategy_kind: str, world_size: int) -> EngineKind:
    """The engine a strategy runs as at `world_size`: DDP alone is the bare module ("single");
    FSDP2 and DeepSpeed keep their kind alone too (they run under a group of one). The planner,
    the engine builder and pre-flight all decide it here."""
    if strategy_kind == "ddp" and world_size == 1:
        return "single"
    if strategy_kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {strategy_kind!r}; expected one of {ENGINE_KINDS}")
    return strategy_kind  # type: ignore[return-value]


def checkpoint_format(kind: str) -> CheckpointFormat:
    """The checkpoint format an engine kind writes, known without building the engine."""
    return "deepspeed" if kind == "deepspeed" else "torch"


@dataclass
class Strategy:
    """A resolved strategy: the engine to use and what it shards or offloads."""

    kind: EngineKind  # what the file names: "ddp" | "fsdp" | "deepspeed" (never "single": see `engine_kind`)
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
