"""Strategy files: which distribution engine shards what, read from one JSON file.

DeepSpeed files are DeepSpeed's own schema, so a user's existing `ds_config.json` drops in
and is honoured as written: `"auto"` (or absent) values are filled from the run config and
each fill is reported, a number that contradicts the run config is an error naming both, a
scheduler the file names is the one DeepSpeed uses, and a key DeepSpeed does not read is an
error naming the closest one it does. FSDP2 and DDP files use a small schema of ours:

    {"kind": "fsdp", "reshard_after_forward": true, "offload": false}
    {"kind": "ddp"}

`reshard_after_forward: false` keeps parameters gathered between forward and backward
(ZeRO-2-like); `offload: true` is FSDP2's CPUOffloadPolicy (on a CPU machine it runs, the host being the device).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from harness.config.deepspeed_keys import parsed_zero_config
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
    raw: dict[str, Any] = field(default_factory=dict)  # the file as written (with the launcher's offload devices laid on)
    # What the launcher asked that cannot be honoured: refused together with the file's own problems
    problems: list[str] = field(default_factory=list)

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
    shipped = shipped_names()
    hint = did_you_mean(os.path.basename(name_or_path).removesuffix(".json"), shipped, cutoff=0.6) or f" (shipped: {', '.join(shipped)})"
    raise ConfigError(f"strategy '{name_or_path}' is neither a file nor a name in ds_configs/{hint}")


def shipped_names() -> list[str]:
    """The strategies harness ships (ds_configs/), by name: the one catalogue that launcher flags,
    the planner's search and its advice point into."""
    return sorted(f.removesuffix(".json") for f in os.listdir(DS_CONFIG_DIR) if f.endswith(".json")) if os.path.isdir(DS_CONFIG_DIR) else []


@functools.cache
def _shipped_facts(name: str) -> tuple[str, int, str, str]:
    s = load_strategy(name, env={})
    return s.kind, s.zero_stage, s.offload_optimizer, s.offload_params


def shipped_with(kind: str, stage: int, offload_optimizer: str = "none", offload_params: str = "none") -> str | None:
    """The shipped strategy with these engine facts (kind, ZeRO stage equivalent, offload devices),
    or None. Only files of ``kind`` are read: reading a DeepSpeed file imports DeepSpeed's config
    classes, which a torch-engine run never needs."""
    for name in shipped_names():
        if read_strategy_file(strategy_path(name)).get("kind", "deepspeed") != kind:
            continue
        if _shipped_facts(name) == (kind, stage, offload_optimizer, offload_params):
            return name
    return None


def strategy_from_launcher(env: dict[str, str] | None = None) -> str | None:
    """The strategy an `accelerate launch --use_deepspeed/--use_fsdp` command asked for.

    accelerate passes its plugin choice to the script only as environment variables; we
    honour them (so accelerate users keep their habits) but apply the strategy ourselves,
    because on CPU accelerate silently drops FSDP and miscounts DeepSpeed ranks. The offload
    devices are laid onto the file chosen here by `launcher_deepspeed_settings`.
    """
    env = dict(os.environ) if env is None else env
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
            return env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        opt = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none") or "none"
        par = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") or "none"
        # The shipped file with exactly these facts; else the stage's own file, the launcher's offload
        # devices laid on (NVMe always so: its path is the launcher's, never the shipped file's).
        same = shipped_with("deepspeed", int(stage), opt, par) if stage.isdigit() and "nvme" not in (opt, par) else None
        return same or f"zero{stage}"
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        sharding = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
        offload = env.get("FSDP_OFFLOAD_PARAMS", "").lower() == "true"  # FSDP2's CPU offload, which reshards
        if sharding in ("NO_SHARD", "3") and not offload:  # every rank holds everything: DDP
            return shipped_with("ddp", 0)
        reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
        stage = 2 if not offload and (sharding in ("SHARD_GRAD_OP", "2") or reshard == "false") else 3
        return shipped_with("fsdp", stage, "cpu" if offload else "none", "cpu" if offload else "none")
    return None


def launcher_deepspeed_settings(raw: dict[str, Any], env: dict[str, str]) -> list[str]:
    """Lay an `accelerate launch` command's ZeRO settings onto the DeepSpeed dict `raw` (in place):
    `--offload_optimizer_device`/`--offload_param_device` set the file's offload blocks where it
    leaves them out, `--zero_stage` must be the file's stage, `--zero3_init_flag false` is refused at
    stage 3 (harness always builds ZeRO-3 models partitioned, under `zero.Init`). Returns one
    problem line per setting it cannot honour; nothing is dropped silently."""
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return []
    problems = []
    zero = raw.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        return []  # refused with its own line by _deepspeed_strategy
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage and stage != str(zero.get("stage", 0)):
        problems.append(
            f"accelerate launch --zero_stage {stage} contradicts zero_optimization.stage={zero.get('stage', 0)}; drop one of the two"
        )
    for var, block, flag in (
        ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER", "offload_optimizer", "--offload_optimizer_device"),
        ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM", "offload_param", "--offload_param_device"),
    ):
        device = env.get(f"{var}_DEVICE", "").lower()
        if not device:
            continue
        current = ((zero.get(block) or {}) if isinstance(zero.get(block), dict) else {}).get("device", "none") or "none"
        if current == device:
            continue
        if current != "none" and zero.get(block):
            problems.append(
                f"accelerate launch {flag} {device} contradicts zero_optimization.{block}.device={current!r}; drop one of the two"
            )
        elif device == "nvme" and env.get(f"{var}_NVME_PATH", "none").lower() not in ("", "none"):
            zero[block] = {"device": "nvme", "nvme_path": env[f"{var}_NVME_PATH"], "pin_memory": True}
        elif device == "nvme":
            problems.append(
                f"accelerate launch {flag} nvme needs an NVMe path: export {var}_NVME_PATH "
                "(accelerate's launcher does not pass --*_nvme_path) or use --deepspeed_config_file"
            )
        elif device != "none":
            zero[block] = {"device": device, "pin_memory": True}
    init = env.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "").lower()
    if init == "false" and zero.get("stage") == 3:
        problems.append(
            "accelerate launch --zero3_init_flag false: harness always builds a ZeRO-3 model partitioned (zero.Init), "
            "never whole on each rank first; set it true"
        )
    return problems


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
        launcher_problems = launcher_deepspeed_settings(raw, dict(os.environ) if env is None else env)
        strategy = _deepspeed_strategy(name, path, raw)
        strategy.problems = launcher_problems
        return strategy
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
    """The engine facts of a DeepSpeed file (stage, offload devices), read as DeepSpeed reads them:
    its own zero_optimization model maps deprecated spellings (`cpu_offload: true` is today's
    `offload_optimizer.device: cpu`). Everything else in the file (unknown keys, values DeepSpeed
    refuses, contradictions with the run config) is checked in one pass where the file is
    resolved (`resolve_deepspeed_config`), so one refusal names every problem."""
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{path}: zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    parsed = parsed_zero_config(zero)
    devices = {}
    for what in ("offload_optimizer", "offload_param"):
        block = getattr(parsed, what, None) if parsed is not None else (zero.get(what) or None)
        device = (block.get("device") if isinstance(block, dict) else getattr(block, "device", None)) if block else None
        device = str(getattr(device, "value", device) or "none")
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{path}: zero_optimization.{what}.device must be none, cpu or nvme, got {device!r}")
        devices[what] = device
    off_opt, off_par = devices["offload_optimizer"], devices["offload_param"]
    if off_par != "none" and stage != 3:
        raise ConfigError(f"{path}: offload_param needs zero_optimization.stage 3 (got stage {stage})")
    if off_opt != "none" and stage == 0:
        raise ConfigError(f"{path}: offload_optimizer needs zero_optimization.stage 1, 2 or 3 (got stage 0)")
    return Strategy("deepspeed", name, path, zero_stage=stage, offload_optimizer=off_opt, offload_params=off_par, raw=raw)
