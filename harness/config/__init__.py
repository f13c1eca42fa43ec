"""The run config: typed schema, loading with `key=value` overrides, strategy files, and every
rule a config must satisfy (`checks`)."""

from harness.config.checks import check_run, check_values
from harness.config.loading import all_keys, apply_overrides, config_to_dict, load_config, parse_yaml, read_config_file
from harness.config.schema import (
    AC_MODES,
    COMPILE_MODES,
    DATA_FORMATS,
    LORA_QUANTIZE,
    PRECISIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    PruneConfig,
    RunConfig,
)
from harness.config.strategies import DS_CONFIG_DIR, Strategy, load_strategy, resolve_deepspeed_config
from harness.errors import ConfigError

__all__ = [
    "AC_MODES",
    "COMPILE_MODES",
    "DATA_FORMATS",
    "DS_CONFIG_DIR",
    "LORA_QUANTIZE",
    "PRECISIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "MemoryConfig",
    "ModelConfig",
    "OptimConfig",
    "PruneConfig",
    "RunConfig",
    "Strategy",
    "all_keys",
    "apply_overrides",
    "check_run",
    "check_values",
    "config_to_dict",
    "load_config",
    "load_strategy",
    "parse_yaml",
    "read_config_file",
    "resolve_deepspeed_config",
]
