"""Settings a run takes from outside its run config: the flags of an `accelerate launch` command
and the numbers a DeepSpeed file sets itself.

One rule for every such setting, so that a file or a launch command written for another project
runs as written: a value the user wrote in the run config stands; a value the run config leaves
to its default is taken from the launcher or the file, and each one taken is logged; two sources
that give different values are a contradiction, named with both. Nothing is dropped silently:
a launcher setting harness cannot honour is refused in one line.

accelerate hands its flags to the script only as environment variables; `accelerate_launch`
holds what harness does with each (its verdict table) and reads the run config values among
them. The ZeRO stage, offload devices and config file choose the strategy file
(`strategies.load_strategy`); `--zero3_save_16bit_model` fills the file's
`stage3_gather_16bit_weights_on_model_save` (`deepspeed_auto`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from harness.config.accelerate_launch import launcher_values
from harness.config.deepspeed_auto import is_auto
from harness.config.layout import ParallelLayout
from harness.config.loading import is_given
from harness.config.schema import RunConfig
from harness.config.strategies import Strategy
from harness.config.vocabulary import choice_fields

# A DeepSpeed file's top-level numbers harness owns → the run config key each one is
FILE_NUMBERS = {
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "gradient_clipping": "optim.grad_clip",
    "sequence_parallel_size": "parallel.sequence",  # DeepSpeed's Ulysses degree: harness runs ALST for it
}
OPTIMIZER_PARAMS = {"lr": "optim.lr", "weight_decay": "optim.weight_decay", "betas": "optim.betas", "eps": "optim.eps"}
OPTIMIZER_NAMES = choice_fields(RunConfig)["optim.name"][0]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    if _number(a) and _number(b):
        return float(a) == float(b)
    return a == b


def _get(cfg: RunConfig, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def _set(cfg: RunConfig, key: str, value: Any) -> None:
    *section, leaf = key.split(".")
    current = _get(cfg, key)
    if isinstance(current, tuple):
        value = tuple(float(v) for v in value)
    elif isinstance(current, float):
        value = float(value)
    elif isinstance(current, int) and not isinstance(current, bool):
        value = int(value)
    setattr(functools.reduce(getattr, section, cfg), leaf, value)


def file_values(strategy: Strategy) -> dict[str, tuple[Any, str]]:
    """The run config keys a DeepSpeed file sets with a value of its own (not "auto", not absent):
    key → (value, "<file>'s <ds key>")."""
    raw, path = strategy.raw, strategy.path
    out: dict[str, tuple[Any, str]] = {}
    for ds_key, key in FILE_NUMBERS.items():
        if _number(raw.get(ds_key)):
            out[key] = (raw[ds_key], f"{path}'s {ds_key}")
    bf16_name = "bf16" if "bf16" in raw else "bfloat16"  # DeepSpeed's old name, read when bf16 is absent
    enabled = {
        name: (raw.get(block) or {}).get("enabled") if isinstance(raw.get(block), dict) else None
        for name, block in (("bf16", bf16_name), ("fp16", "fp16"))
    }
    on = [name for name, value in enabled.items() if value is True]
    if len(on) == 1:  # both on: DeepSpeed refuses the file itself (reported where it is resolved)
        out["precision"] = (on[0], f"{path}'s {bf16_name if on[0] == 'bf16' else 'fp16'}.enabled")
    opt = raw.get("optimizer")
    if isinstance(opt, dict):
        params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
        kind = opt.get("type")
        if isinstance(kind, str) and not is_auto(kind):
            name = kind.lower()
            name = ("adam" if params.get("adam_w_mode", True) is False else "adamw") if name == "adam" else name
            if name in OPTIMIZER_NAMES:  # any other is refused where the file is resolved
                out["optim.name"] = (name, f"{path}'s optimizer.type")
        for ds_key, key in OPTIMIZER_PARAMS.items():
            value = params.get(ds_key)
            if _number(value) or (isinstance(value, list) and len(value) == 2 and all(map(_number, value))):
                out[key] = (value, f"{path}'s optimizer.params.{ds_key}")
    return out


def _derived_batch(strategy: Strategy, cfg: RunConfig, world: int, fixed: set[str]) -> tuple[str, int, str] | None:
    """A file's train_batch_size with the micro batch or the accumulation left open: the open one,
    by DeepSpeed's own rule (train = micro * accumulation * world; with neither given, the
    accumulation stays and the micro batch follows, as `DeepSpeedConfig._configure_train_batch_size` does)."""
    tbs = strategy.raw.get("train_batch_size")
    if not _number(tbs) or ("micro_batch_size" in fixed and "grad_accum" in fixed):
        return None
    world = ParallelLayout.of(cfg.parallel, world).data  # DeepSpeed's world here is the data-parallel one
    if "micro_batch_size" in fixed:
        per = cfg.micro_batch_size * world
        key, value = "grad_accum", tbs / per
    else:
        per = cfg.grad_accum * world
        key, value = "micro_batch_size", tbs / per
    if value < 1 or value != int(value):
        return None  # refused where the file is resolved: train_batch_size contradicts micro*accum*world
    return key, int(value), f"{strategy.path}'s train_batch_size={tbs} / {per}"


def adopt_settings(
    user: RunConfig, strategy: Strategy, world: int, has_accelerator: bool, env: dict[str, str]
) -> tuple[RunConfig, list[str], list[str]]:
    """The run config with what the launcher and the DeepSpeed file set and the run config leaves
    to its defaults taken in: a copy, the user's config stays as written. Returns (that config,
    notes: one per value taken, problems: one line per contradiction or unsupported setting); the
    caller raises the problems together with the file's others."""
    cfg = copy.deepcopy(user)
    problems: list[str] = []
    notes: list[str] = []
    launcher = launcher_values(env, problems)
    from_file = file_values(strategy) if strategy.kind == "deepspeed" else {}
    fixed: set[str] = set()
    for key in sorted(set(launcher) | set(from_file)):
        sources = [pair for pair in (launcher.get(key), from_file.get(key)) if pair is not None]
        if is_given(cfg, key):
            fixed.add(key)
            for value, source in sources:
                current = _get(cfg, key)
                if key == "precision":  # --mixed_precision bf16 is what precision=bf16_pure computes in
                    current = str(current).removesuffix("_pure")
                if source.startswith("accelerate") and not _equal(value, current):
                    problems.append(f"{source} contradicts the run config's {key}={_get(cfg, key)!r}; drop one of the two")
            continue  # a file's number that differs is named where the file is resolved
        if len(sources) == 2 and not _equal(sources[0][0], sources[1][0]):
            problems.append(f"{sources[0][1]} contradicts {sources[1][1]}={sources[1][0]!r}; drop one of the two")
        value, source = sources[-1]  # the file's, where both (so the file resolves as written)
        notes.append(f"{key}={value!r} (from {source}; the run config leaves {key} unset)")
        _set(cfg, key, value)
        fixed.add(key)
    if strategy.kind == "deepspeed":
        derived = _derived_batch(strategy, cfg, world, fixed | {k for k in ("micro_batch_size", "grad_accum") if is_given(cfg, k)})
        if derived is not None:
            key, value, source = derived
            notes.append(f"{key}={value} (from {source})")
            _set(cfg, key, value)
        if cfg.precision == "fp16" and not has_accelerator:
            source = (
                "the run config's precision"
                if is_given(cfg, "precision")
                else from_file.get("precision", launcher.get("precision", (None, "the run config's precision")))[1]
            )
            if "fp16.enabled" in source:
                way_out = 'set fp16.enabled to false or "auto" in the file (then precision decides: fp32 or bf16)'
            elif source.startswith("accelerate"):
                way_out = "launch with --mixed_precision bf16 or no"
            else:
                way_out = "use precision=bf16 or fp32"
            problems.append(
                f"precision=fp16 (from {source}) under DeepSpeed needs a GPU (DeepSpeed's fp16 optimizer and loss scaler run on "
                f"CUDA) and this machine has none: {way_out}"
            )
    return cfg, notes, problems
