"""DeepSpeed "auto" filling: a strategy file's DeepSpeed dict with every "auto" (or absent value
harness owns) filled from the run config, and every contradiction an error naming both values.

Resolved once per run, in pre-flight (`harness.engine.EnginePlan`), and handed to the engine
and the planner; nothing else calls this.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from harness.config.schema import RunConfig
from harness.config.strategies import Strategy
from harness.errors import ConfigError


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
        raise ConfigError(
            f"{path}: {where}{key}={current!r} contradicts the run config's {ours_name}={ours!r}; set "
            f'{ours_name}={current!r} or "{key}": "auto" in the file'
        )


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
