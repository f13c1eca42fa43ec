"""Reading a run config: YAML/JSON files, `key=value` overrides, typed construction.

Every section is a dataclass (`harness.config.schema`), so an unknown key is an error
naming the closest valid key instead of a silently ignored typo.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from harness.config.checks import check_dead_keys, check_values
from harness.config.schema import RENAMED, RunConfig
from harness.errors import ConfigError, did_you_mean


def is_given(cfg: RunConfig, key: str) -> bool:
    """Whether the user wrote dotted `key` (in the config file or a `key=value` override).

    A value the user did not write is a default, which a setting from outside the run config
    (a DeepSpeed file's own number, an `accelerate launch` flag) may replace; a written one it
    may only contradict. `load_config` records the written keys; a RunConfig built in code
    records none, and then every key counts as written (contradictions are named, nothing is
    replaced silently)."""
    given = getattr(cfg, "given_keys", None)
    return True if given is None else key in given


def given_in(cfg: RunConfig, section: str) -> frozenset[str] | None:
    """The keys of `section` the user wrote, without the section's name; None where `load_config`
    recorded nothing (a RunConfig built in code, or copied by `dataclasses.replace`)."""
    given = getattr(cfg, "given_keys", None)
    return None if given is None else frozenset(k.removeprefix(section + ".") for k in given if k.startswith(section + "."))


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Convert a YAML/JSON/CLI value to the field's declared type, or raise ConfigError."""
    origin = get_origin(typ)
    args = get_args(typ)
    if origin is Literal:  # an enumerated choice: read as its values' type, checked by check_values
        typ, origin, args = type(args[0]), None, ()
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
            if f"{prefix}{key}" in RENAMED:
                raise ConfigError(f"config key '{prefix}{key}' is now {RENAMED[prefix + key]}")
            raise ConfigError(f"unknown config key '{prefix}{key}'{did_you_mean(key, names)}")
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

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            """A key given twice in one mapping is an error (PyYAML keeps the last one silently)."""
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' is given twice (the second would silently win); keep one", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

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
    return yaml.load(text, Loader=_yaml_loader())


def _unique_json_keys(path: str) -> Any:
    """A JSON object hook refusing a key given twice (json keeps the last one silently)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"{path}: key '{key}' is given twice (the second would silently win); keep one")
            seen[key] = value
        return seen

    return hook


def read_config_file(path: str) -> dict[str, Any]:
    """Parse a YAML or JSON config file; syntax errors name the line."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' not found")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (line {line}, byte {e.start}: {raw[e.start : e.start + 4]!r}); save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read ({e.strerror})") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text, object_pairs_hook=_unique_json_keys(path))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    else:
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
    valid = all_keys()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        if key not in valid:
            if key in RENAMED:
                raise ConfigError(f"config key '{key}' is now {RENAMED[key]}")
            raise ConfigError(f"unknown config key '{key}'{did_you_mean(key, valid)}")
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
    cfg.given_keys = frozenset(_dotted(data))  # what the user wrote (`is_given`): not a config key, so not a field
    check_values(cfg)
    check_dead_keys(data, cfg)
    hold_out_calibration_when_pruning(cfg)
    return cfg


def hold_out_calibration_when_pruning(cfg: RunConfig) -> None:
    """A run that does not prune trains on the documents a calibration split would hold
    (`data.calib_fraction` 0), as TRL and axolotl hold out nothing they do not use; a written
    `data.calib_fraction` is kept (a model trained to be pruned later must not train on the
    documents it will be calibrated on). A pruning run's splits are those of its written or
    default fractions, as before. Done here, once, so that every reader of `cfg.data` (the
    cache key, pre-flight, the planner, `harness.data`) sees the same splits."""
    if not cfg.prune.enabled and not is_given(cfg, "data.calib_fraction"):
        cfg.data.calib_fraction = 0.0


def _dotted(data: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of the leaves of a nested config dict."""
    out = []
    for key, value in data.items():
        out += _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key]
    return out


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
