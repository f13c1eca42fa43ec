"""DeepSpeed's own schema: which keys it reads, what its config classes accept, what it ignores.

Kept apart from strategy loading (`strategies`) and "auto" filling (`deepspeed_auto`) because
it is the one part that asks DeepSpeed itself (its config parser and pydantic models), lazily.
Every check here returns its findings as lines instead of raising at the first, so that a
file with four mistakes is refused once, naming all four.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from harness.errors import did_you_mean

OUR_DEEPSPEED_KEYS = {"comment"}  # harness's own keys a DeepSpeed file may carry (DeepSpeed ignores them)
# Keys DeepSpeed's config reads only inside a live process group (`DeepSpeedConfig.__init__`, past
# `dist.get_rank()`), where the empty-dict probe below never gets: the Ulysses degree, which harness
# also reads (it is `parallel.sequence`).
READ_UNDER_A_PROCESS_GROUP = {"sequence_parallel_size"}
# Other tools' blocks that look like a misspelling of a DeepSpeed key but are not one: ignored by
# DeepSpeed (warned), and refused by `layout_problems` where they would change the layout.
OTHER_TOOLS_BLOCKS = {"sequence_parallel"}  # LLaMA-Factory's ALST block, beside DeepSpeed's sequence_parallel_size
# An unknown top-level key this close to one DeepSpeed reads is taken for a misspelling (refused:
# `zero_optimisation` would silently train at stage 0); any other DeepSpeed ignores, and so do we (warned).
MISSPELLING_CUTOFF = 0.8


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
def _deepspeed_config_classes() -> tuple[Any, Any, frozenset[str]]:
    """DeepSpeed's config module, its zero_optimization model and the ZeRO keys it rejects itself as removed."""
    import deepspeed.runtime.config as ds_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return ds_config, DeepSpeedZeroConfig, frozenset(getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}))


def _deepspeed_zero_schema() -> tuple[Any, frozenset[str]]:
    _, model, removed = _deepspeed_config_classes()
    return model, removed


def zero_field_names(key: str) -> tuple[str, ...]:
    """Every spelling DeepSpeed accepts for one zero_optimization field (`stage3_prefetch_bucket_size`
    and its field name `prefetch_bucket_size`); the key alone when DeepSpeed has no such field."""
    model, _ = _deepspeed_zero_schema()
    for name, info in model.model_fields.items():
        names = {n for n in (name, info.alias, info.validation_alias) if isinstance(n, str)}
        if key in names:
            return tuple(sorted(names))
    return (key,)


def zero_field_default(key: str) -> tuple[bool, Any]:
    """(True, DeepSpeed's default) for a zero_optimization field harness does not own, else (False, None)."""
    model, _ = _deepspeed_zero_schema()
    for name, info in model.model_fields.items():
        if key in (name, info.alias, info.validation_alias) and not info.is_required():
            return True, info.get_default()
    return False, None


def _unknown_key(where: str, key: str, known: set[str]) -> str:
    hint = did_you_mean(key, sorted(known), cutoff=0.6) or " (DeepSpeed reads no such key; see https://www.deepspeed.ai/docs/config-json/)"
    return f"unknown DeepSpeed key '{where}{key}'{hint}"


def _model_key_problems(block: dict[str, Any], model: Any, also: frozenset[str], where: str) -> list[str]:
    """Every key of `block` that `model` (a DeepSpeed config model) does not declare; nested blocks likewise."""
    if model.model_config.get("extra") == "allow":  # a block DeepSpeed passes through as it is
        return []
    fields = _model_fields(model)
    problems = []
    for key, value in block.items():
        if key not in fields and key not in also:
            problems.append(_unknown_key(where, key, set(fields) | also))
        elif isinstance(value, dict) and fields.get(key) is not None:
            problems += _model_key_problems(value, fields[key], frozenset(), f"{where}{key}.")
    return problems


def key_problems(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(problems, warnings) about the file's keys. A top-level key DeepSpeed does not read is a
    problem when it is a near miss of one it does (a misspelt `zero_optimisation` would train
    silently at ZeRO stage 0), else a warning: DeepSpeed ignores it (`_comment`,
    `cuda_visible_devices`), and so does harness. Inside zero_optimization every key must be one
    DeepSpeed's own model declares (DeepSpeed itself refuses any other)."""
    top = set(deepspeed_top_level_keys()) | OUR_DEEPSPEED_KEYS | READ_UNDER_A_PROCESS_GROUP
    problems, warnings = [], []
    for key in raw:
        if key in top:
            continue
        if not key.startswith("_") and key not in OTHER_TOOLS_BLOCKS and did_you_mean(key, sorted(top), cutoff=MISSPELLING_CUTOFF):
            problems.append(_unknown_key("", key, top))
        else:
            warnings.append(f"'{key}' is not a key DeepSpeed reads; DeepSpeed ignores it, and so does harness")
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        model, removed = _deepspeed_zero_schema()
        problems += _model_key_problems(zero, model, removed, "zero_optimization.")
    return problems, warnings


def layout_problems(raw: dict[str, Any]) -> list[str]:
    """Settings that change how the model is laid out across ranks, which harness (data-parallel
    ZeRO only) does not build: DeepSpeed would crash on them after the model is loaded."""
    problems = []
    tp = raw.get("tensor_parallel")
    if isinstance(tp, dict):
        inner = tp.get("tp", tp.get("tensor_parallel")) or {}
        size = max(_int(tp.get("autotp_size")), _int(inner.get("tp_size")) if isinstance(inner, dict) else 0)
        if size > 1:
            problems.append(
                f"tensor_parallel (AutoTP, size {size}) splits each layer across ranks, which harness does not "
                "support (it trains data-parallel with ZeRO): remove the tensor_parallel block"
            )
    if "pipeline" in raw:
        problems.append(
            "pipeline (DeepSpeed pipeline parallelism) needs a PipelineModule, which harness does not build: remove the pipeline block"
        )
    sp = raw.get("sequence_parallel")  # LLaMA-Factory's ALST block (ds_z3_alst_config.json): read by LLaMA-Factory, not DeepSpeed
    if isinstance(sp, dict) and sp.get("enabled", True) is not False and _int(sp.get("size", 1)) > 1:
        problems.append(
            f"sequence_parallel (LLaMA-Factory's ALST block, size {_int(sp['size'])}) is read by LLaMA-Factory, not DeepSpeed: "
            f"set parallel.sequence={_int(sp['size'])} (harness then runs DeepSpeed's ALST), memory.tiled_mlp_tokens for its "
            "tiling, and remove the block (or set enabled false)"
        )
    return problems


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _pydantic_lines(block: str, exc: Any) -> list[str]:
    """One line per error of a pydantic ValidationError raised by DeepSpeed's model for `block`."""
    lines = []
    for err in exc.errors():
        where = ".".join(p for p in [block, *(str(p) for p in err.get("loc", ()))] if p)
        if err.get("type") == "extra_forbidden":
            lines.append(f"unknown DeepSpeed key '{where}' (DeepSpeed's {exc.title} has no such field)")
        else:
            lines.append(f"{where}={err.get('input')!r}: {err.get('msg')} (DeepSpeed's {exc.title})")
    return lines


def deepspeed_problems(ds: dict[str, Any], world_size: int, cross_checks: bool = True) -> list[str]:
    """What DeepSpeed's own config classes (`DeepSpeedConfig` and its pydantic models) refuse in the
    resolved dict, found before launch instead of as a traceback after the model is built.

    Each top-level block is parsed alone first, so that every faulty block is named (DeepSpeed
    itself stops at the first); then the whole dict, for the checks across blocks (batch
    arithmetic at this world size, fp16 with bf16, master weights without ZeRO), unless
    `cross_checks` is off (the dict still holds problems of ours, such as an unfilled "auto")."""
    ds_config = _deepspeed_config_classes()[0]

    def parse(d: dict[str, Any], whole: bool) -> None:
        probe = object.__new__(ds_config.DeepSpeedConfig)
        probe.global_rank, probe.world_size = 0, world_size
        probe._param_dict = d
        if hasattr(ds_config, "_reject_removed_config_keys"):
            ds_config._reject_removed_config_keys(d)
        probe._initialize_params(copy.copy(d))
        if whole:
            probe._configure_train_batch_size()
            probe._do_sanity_check()

    problems: list[str] = []
    for key, value in ds.items():
        try:
            parse({key: copy.deepcopy(value)}, whole=False)
        except Exception as exc:  # pydantic's errors one line each; DeepSpeed's own asserts: their first line
            problems += _pydantic_lines(key, exc) if _is_validation_error(exc) else [f"{key}: DeepSpeed refuses it: {_first_line(exc)}"]
    if cross_checks and not problems:
        try:
            parse(copy.deepcopy(ds), whole=True)
        except Exception as exc:
            problems += _pydantic_lines("", exc) if _is_validation_error(exc) else [f"DeepSpeed refuses the config: {_first_line(exc)}"]
    return problems


def _is_validation_error(exc: BaseException) -> bool:
    """A pydantic ValidationError, recognised without importing pydantic here (DeepSpeed brings it)."""
    return callable(getattr(exc, "errors", None)) and isinstance(getattr(exc, "title", None), str)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:240]


def parsed_zero_config(zero: dict[str, Any]) -> Any:
    """DeepSpeed's own reading of a zero_optimization block (its deprecated spellings such as
    `cpu_offload` mapped to today's), or None where DeepSpeed refuses it (reported by `deepspeed_problems`)."""
    model, _ = _deepspeed_zero_schema()
    try:
        return model(**copy.deepcopy(zero))
    except Exception:
        return None
