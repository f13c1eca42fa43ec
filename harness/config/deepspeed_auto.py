"""DeepSpeed "auto" filling: a strategy file's DeepSpeed dict with every "auto" (or absent value
harness owns) filled from the run config, every contradiction named with both values, and the
result checked by DeepSpeed's own config classes, all problems reported in one refusal.

Resolved once per run, in pre-flight (`harness.engine.EnginePlan`), and handed to the engine
and the planner; nothing else calls this. The run config has by then taken what the file sets
and the user left to defaults (`drop_in.adopt_settings`), so a number here that differs from
the run config is one the user wrote in both places.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from harness.config.deepspeed_keys import deepspeed_problems, key_problems, layout_problems, zero_field_default, zero_field_names
from harness.config.layout import ParallelLayout
from harness.config.schema import OptimConfig, RunConfig
from harness.config.strategies import Strategy
from harness.errors import ConfigError


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def _same(current: Any, ours: Any) -> bool:
    """A value in the file equals the run config's (numbers compared as floats, lists element-wise)."""
    if isinstance(ours, (list, tuple)):
        return isinstance(current, (list, tuple)) and len(current) == len(ours) and all(_same(a, b) for a, b in zip(current, ours))
    return isinstance(current, (int, float)) and not isinstance(current, bool) and float(current) == float(ours)


def _note(filled: list[str] | None, key: str, value: Any, source: str) -> None:
    if filled is not None:
        filled.append(f"{key}={value} (from {source})")


def raise_problems(path: str, problems: list[str]) -> None:
    """One ConfigError naming every problem: one line when there is one, else one line each."""
    if len(problems) == 1:
        raise ConfigError(f"{path}: {problems[0]}")
    if problems:
        raise ConfigError(f"{path}: {len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))


def _settle(
    ds: dict[str, Any], key: str, ours: Any, ours_name: str, problems: list[str], filled: list[str] | None = None, where: str = ""
) -> None:
    """Fill an "auto" (or absent) value from the run config; a different number is a problem."""
    current = ds.get(key, "auto")
    if is_auto(current):
        ds[key] = ours
        _note(filled, f"{where}{key}", ours, ours_name)
    elif not _same(current, ours):
        problems.append(
            f"{where}{key}={current!r} contradicts the run config's {ours_name}={ours!r}; set "
            f'{ours_name}={current!r} or "{key}": "auto" in the file'
        )


def _optimizer_kind(type_name: Any, params: dict[str, Any]) -> str:
    """What DeepSpeed runs for an optimizer type, in optim.name's words (its "Adam" is AdamW unless adam_w_mode is false)."""
    name = str(type_name).lower()
    if name == "adam":
        return "adam" if params.get("adam_w_mode", True) is False else "adamw"
    return name


def _resolve_optimizer(ds: dict[str, Any], o: OptimConfig, problems: list[str], filled: list[str] | None) -> None:
    """The file's optimizer must be the run config's: "auto"/absent values are filled, any other is compared."""
    opt = ds["optimizer"]
    if not isinstance(opt, dict) or not isinstance(opt.setdefault("params", {}), dict):
        problems.append("optimizer and optimizer.params must be objects")
        return
    params = opt["params"]
    if is_auto(opt.get("type", "auto")):
        opt["type"] = {"adamw": "AdamW", "adam": "Adam"}.get(o.name, "SGD")
        _note(filled, "optimizer.type", opt["type"], "optim.name")
        if o.name == "adam" and is_auto(params.get("adam_w_mode", "auto")):
            params["adam_w_mode"] = False  # DeepSpeed's "Adam" is AdamW unless told otherwise
            _note(filled, "optimizer.params.adam_w_mode", False, "optim.name=adam")
    kind = _optimizer_kind(opt["type"], params)
    if kind != o.name:
        why = " (DeepSpeed runs 'Adam' as AdamW unless optimizer.params.adam_w_mode is false)" if str(opt["type"]).lower() == "adam" else ""
        problems.append(f"optimizer.type={opt['type']!r} contradicts the run config's optim.name={o.name!r}{why}")
        return
    ours: dict[str, tuple[Any, str]] = {"lr": (o.lr, "optim.lr"), "weight_decay": (o.weight_decay, "optim.weight_decay")}
    if kind in ("adam", "adamw"):  # torch's SGD takes neither
        ours.update(betas=(list(o.betas), "optim.betas"), eps=(o.eps, "optim.eps"))
    for key, (value, name) in ours.items():
        _settle(params, key, value, name, problems, filled, where="optimizer.params.")


def _resolve_scheduler(ds: dict[str, Any], o: OptimConfig, steps: int, problems: list[str], filled: list[str] | None) -> None:
    """A scheduler the file names is DeepSpeed's to run, as written (its "auto" params filled); a
    "type": "auto" one, or none, means harness's own schedule drives the LR (DeepSpeed gets none)."""
    sched = ds.get("scheduler")
    if sched is None or (isinstance(sched, dict) and is_auto(sched.get("type"))):
        ds.pop("scheduler", None)
        if filled is not None:
            filled.append(
                f"scheduler=harness's {o.schedule} schedule (from optim.schedule, optim.warmup_steps={o.warmup_steps}, "
                f"optim.min_lr_ratio={o.min_lr_ratio})"
            )
        return
    if not isinstance(sched, dict) or not isinstance(sched.get("type"), str) or not isinstance(sched.get("params", {}), dict):
        problems.append(
            "scheduler needs a 'type' (a DeepSpeed scheduler such as WarmupLR, or \"auto\" for harness's schedule) "
            "and 'params' as an object"
        )
        return
    autos = {  # DeepSpeed's (and HF's) "auto" scheduler params, from the run config
        "warmup_num_steps": (o.warmup_steps, "optim.warmup_steps"),
        "total_num_steps": (steps, "steps"),
        "warmup_max_lr": (o.lr, "optim.lr"),
        "warmup_min_lr": (o.lr * o.min_lr_ratio, "optim.lr*optim.min_lr_ratio"),
        "cos_min_ratio": (o.min_lr_ratio, "optim.min_lr_ratio"),
    }
    params = sched.get("params", {})
    for key, value in params.items():
        if is_auto(value) and key in autos:
            params[key] = autos[key][0]
            _note(filled, f"scheduler.params.{key}", autos[key][0], autos[key][1])
    # any other "auto" is named by the leftover check in resolve_deepspeed_config


def _resolve_precision(ds: dict[str, Any], precision: str, problems: list[str], filled: list[str] | None, has_accelerator: bool) -> None:
    """bf16/fp16 "enabled" from `precision`. DeepSpeed reads its old name `bfloat16` when `bf16` is
    absent, so that block is the one filled and checked (adding a `bf16` block would hide it)."""
    if "bf16" in ds and "bfloat16" in ds:
        problems.append("both 'bf16' and its old name 'bfloat16' are given and DeepSpeed reads only 'bf16': remove 'bfloat16'")
    bf16 = "bfloat16" if "bfloat16" in ds and "bf16" not in ds else "bf16"
    for section, want in ((bf16, precision == "bf16"), ("fp16", precision == "fp16")):
        block = ds.setdefault(section, {})
        if not isinstance(block, dict):
            problems.append(f'{section} must be an object like {{"enabled": true}}')
            continue
        enabled = block.get("enabled", "auto")
        if is_auto(enabled):
            block["enabled"] = want
            _note(filled, f"{section}.enabled", want, f"precision={precision}")
        elif bool(enabled) != want:
            settle = (
                f"set precision={'fp16' if section == 'fp16' else 'bf16'}"
                if enabled
                else f"set precision=fp32 or {bf16 if section == 'fp16' else 'fp16'}"
            )
            if section == "fp16" and enabled and not has_accelerator:  # the other way out leads to a refusal on CPU
                settle = 'DeepSpeed\'s fp16 needs a GPU, so on this CPU-only machine set fp16.enabled to false or "auto"'
            else:
                settle += f' or "{section}": {{"enabled": "auto"}} in the file'
            problems.append(f"{section}.enabled={enabled!r} contradicts the run config's precision={precision!r}; {settle}")


def _fill_zero_sizes(zero: dict[str, Any], hidden_size: int | None, problems: list[str], filled: list[str] | None) -> None:
    """zero_optimization's "auto" sizes, under any spelling DeepSpeed accepts (`prefetch_bucket_size`
    is `stage3_prefetch_bucket_size`), from the model's width."""
    h = hidden_size or 0
    size_autos = {
        "reduce_bucket_size": h**2,
        "allgather_bucket_size": h**2,
        "stage3_prefetch_bucket_size": int(0.9 * h**2),
        "stage3_param_persistence_threshold": 10 * h,
        # About two decoder blocks (12·h² parameters each): DeepSpeed keeps a gathered parameter
        # whose next use lies within this many parameters (and prefetches up to it). Its default
        # 1e9 exceeds a whole forward plus backward of models up to ~500M parameters, so from the
        # second step on nothing is released and every rank holds the whole model; two blocks
        # release like FSDP2 (the current block and the next one gathered).
        "stage3_max_live_parameters": 24 * h**2,
        "stage3_max_reuse_distance": 24 * h**2,
    }
    for canonical, value in size_autos.items():
        for key in zero_field_names(canonical):
            if is_auto(zero.get(key)):
                if not hidden_size:
                    problems.append(f"zero_optimization.{key} is 'auto' but the model's hidden size is unknown; give a number")
                    continue
                zero[key] = value
                _note(filled, f"zero_optimization.{key}", value, f"the model's hidden size {hidden_size}")


def _fill_zero_rest(zero: dict[str, Any], env: dict[str, str], problems: list[str], filled: list[str] | None) -> None:
    """Every other "auto" in zero_optimization: `stage3_gather_16bit_weights_on_model_save` from
    `accelerate launch --zero3_save_16bit_model` (as accelerate fills it), else DeepSpeed's own default
    for the field (what DeepSpeed itself makes of "auto": its models drop the value)."""
    save16 = env.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "").lower()
    spellings = zero_field_names("stage3_gather_16bit_weights_on_model_save")
    if save16 in ("true", "false") and zero.get("stage") == 3 and not any(k in zero for k in spellings):
        zero["stage3_gather_16bit_weights_on_model_save"] = "auto"  # absent: filled like "auto" just below
    for key in list(zero):
        if key in spellings and save16 in ("true", "false"):
            if is_auto(zero[key]):
                zero[key] = save16 == "true"
                _note(filled, f"zero_optimization.{key}", zero[key], f"accelerate launch --zero3_save_16bit_model {save16}")
            elif zero[key] is not (save16 == "true"):
                problems.append(
                    f"zero_optimization.{key}={zero[key]!r} contradicts accelerate launch --zero3_save_16bit_model {save16}; "
                    "drop one of the two"
                )
        elif is_auto(zero[key]):
            known, default = zero_field_default(key)
            if known:
                default = getattr(default, "value", default)  # an enum's value; DeepSpeed's pp_int prints with commas
                zero[key] = int(default) if isinstance(default, int) and not isinstance(default, bool) else default
                _note(filled, f"zero_optimization.{key}", zero[key], "DeepSpeed's default; harness has no value of its own for it")


def resolve_deepspeed_config(
    strategy: Strategy,
    cfg: RunConfig,
    world_size: int,
    hidden_size: int | None = None,
    filled: list[str] | None = None,
    has_accelerator: bool = True,
    env: dict[str, str] | None = None,
    problems: list[str] | None = None,
    warnings: list[str] | None = None,
) -> dict[str, Any]:
    """DeepSpeed's config dict with every "auto" (or absent value harness owns) filled from the run config.

    The file is otherwise honoured as written: a value that contradicts the run config, a key
    DeepSpeed does not read (a near miss of one it does), a layout harness does not build and
    anything DeepSpeed's own config classes refuse are all collected and raised as one
    ConfigError, together with `problems` found before (the launcher's). `filled` collects one
    entry per value harness filled in; `warnings` one per key DeepSpeed ignores.
    """
    path = strategy.path
    env = dict(os.environ) if env is None else env
    problems = list(problems or []) + list(strategy.problems)
    ds = copy.deepcopy(strategy.raw)
    bad_keys, ignored = key_problems(ds)
    problems += bad_keys + layout_problems(ds)
    if warnings is not None:
        warnings += ignored
    _settle(ds, "train_micro_batch_size_per_gpu", cfg.micro_batch_size, "micro_batch_size", problems, filled)
    _settle(ds, "gradient_accumulation_steps", cfg.grad_accum, "grad_accum", problems, filled)
    sequence = cfg.parallel.sequence
    if sequence > 1 or "sequence_parallel_size" in ds:  # DeepSpeed's Ulysses degree (ALST): parallel.sequence
        _settle(ds, "sequence_parallel_size", sequence, "parallel.sequence", problems, filled)
    data_world = ParallelLayout.of(cfg.parallel, world_size).data
    _settle(
        ds,
        "train_batch_size",
        cfg.micro_batch_size * cfg.grad_accum * data_world,
        f"micro_batch_size*grad_accum*data-parallel world ({cfg.micro_batch_size}*{cfg.grad_accum}*{data_world})",
        problems,
        filled,
    )
    _settle(ds, "gradient_clipping", cfg.optim.grad_clip, "optim.grad_clip", problems, filled)
    _resolve_precision(ds, cfg.precision, problems, filled, has_accelerator)
    if "optimizer" in ds:
        _resolve_optimizer(ds, cfg.optim, problems, filled)
    _resolve_scheduler(ds, cfg.optim, cfg.steps, problems, filled)
    zero = ds.get("zero_optimization", {})
    _fill_zero_sizes(zero, hidden_size, problems, filled)
    _fill_zero_rest(zero, env, problems, filled)
    for off in ("offload_optimizer", "offload_param"):
        block = zero.get(off) or {}
        if isinstance(block, dict) and block.get("device") == "nvme":
            nvme = block.get("nvme_path")
            if not nvme or not os.path.isdir(nvme) or not os.access(nvme, os.W_OK):
                problems.append(
                    f"zero_optimization.{off}.nvme_path={nvme!r} is missing or not writable; set it to a writable NVMe directory"
                )
    unknown = {key for key in ds if any(f"unknown DeepSpeed key '{key}'" in p for p in bad_keys)}
    for where, _ in _find_autos(ds):
        if where.split(".")[0] in unknown or any(f"'{where}'" in p or p.startswith(f"{where} ") for p in problems):
            continue  # inside a key already named as unknown, or named by a problem of its own
        problems.append(f"'{where}' is 'auto' but harness cannot fill it; give a value")
    for line in deepspeed_problems(ds, data_world, cross_checks=not problems):
        head = line.split(" (")[0]
        if not any(p.split(" (")[0] == head for p in problems):  # already named (with a did-you-mean) by key_problems
            problems.append(line)
    raise_problems(path, problems)
    return ds


def _find_autos(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every value still "auto", by dotted key."""
    if isinstance(node, dict):
        return [found for key, value in node.items() for found in _find_autos(value, f"{prefix}{key}.")]
    if is_auto(node):
        return [(prefix.rstrip("."), node)]
    return []
