"""DeepSpeed's own key schema: a key DeepSpeed does not read is an error naming the closest one.

Kept apart from strategy loading (`strategies`) and "auto" filling (`deepspeed_auto`) because
it is the one part that asks DeepSpeed itself (its config parser and pydantic models), lazily.
"""

from __future__ import annotations

import functools
from typing import Any

from harness.errors import ConfigError, did_you_mean

OUR_DEEPSPEED_KEYS = {"comment"}  # harness's own keys a DeepSpeed file may carry (DeepSpeed ignores them)


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
