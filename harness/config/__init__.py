"""The run config: typed schema, loading with `key=value` overrides, strategy files, and every
rule a config must satisfy (`checks`).

Modules by concern: `schema` (dataclasses, choice vocabularies, the defaults that depend on
what is trained), `loading` (files and overrides), `presets` (the model presets' names and
shapes), `strategies` (strategy files, the `EngineKind` vocabulary and its one rule
`engine_kind`), `deepspeed_keys` (DeepSpeed's key schema), `deepspeed_auto` ("auto" filling of
a DeepSpeed dict from the run config), `drop_in` (what the launcher and a DeepSpeed file set
and the run config leaves to defaults), `accelerate_table` (the verdict on each
`accelerate launch` flag and config-file key), `accelerate_launch` (the reading of its variables), `checks` (every rule on a config),
`layout` (`ParallelLayout`: the world's ranks as data x sequence, built once per run),
`sequence_checks` (how long a sequence may be, and what splitting it over ranks runs with)."""

from harness.config.accelerate_launch import launcher_settings, wrap_class_problem
from harness.config.checks import (
    aux_loss_coefficient,
    check_expert_parallel,
    check_optimizer_in_backward,
    check_run,
    check_strategy_against_run,
    check_values,
)
from harness.config.deepspeed_auto import resolve_deepspeed_config
from harness.config.drop_in import adopt_settings
from harness.config.layout import ParallelLayout
from harness.config.loading import all_keys, apply_overrides, config_to_dict, given_in, is_given, load_config, parse_yaml, read_config_file
from harness.config.presets import PRESETS, Preset, is_preset
from harness.config.prune_methods import (
    DECISION_FACTS,
    PER_ROW_BASES,
    PRUNE_METHOD_FACTS,
    DecisionFacts,
    MethodFacts,
    decision_facts,
    method_facts,
    needs_calibration,
    row_score,
)
from harness.config.prune_modes import check_method_keys, check_original, check_prune_widths, is_original, resolve_prune
from harness.config.schema import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    MoeConfig,
    OptimConfig,
    ParallelConfig,
    PruneConfig,
    RunConfig,
    Section,
    default_lr,
    freeze,
)
from harness.config.sequence_checks import (
    SequenceLimit,
    check_sequence_heads,
    check_sequence_length,
    check_sequence_parallel,
    sequence_limit,
)
from harness.config.strategies import (
    DS_CONFIG_DIR,
    ENGINE_KINDS,
    CheckpointFormat,
    EngineKind,
    Strategy,
    checkpoint_format,
    engine_kind,
    load_strategy,
)
from harness.config.strategy_facts import StrategyFacts, facts_of, more_sharding, shipped_equivalent, shipped_facts, shipped_names
from harness.config.vocabulary import (
    AC_MODES,
    BF16_WEIGHT_OPTIMIZERS,
    COMPILE_MODES,
    DATA_FORMATS,
    EMBEDDED_CORPORA,
    INSTRUCTION_FORMATS,
    LORA_QUANTIZE,
    OPTIMIZER_LIBRARY,
    OPTIMIZER_NAMES,
    PRECISIONS,
    PRUNE_BASES,
    PRUNE_METHODS,
)
from harness.errors import ConfigError

__all__ = [
    "DECISION_FACTS",
    "DecisionFacts",
    "decision_facts",
    "ParallelLayout",
    "StrategyFacts",
    "facts_of",
    "more_sharding",
    "shipped_equivalent",
    "shipped_facts",
    "shipped_names",
    "AC_MODES",
    "launcher_settings",
    "wrap_class_problem",
    "COMPILE_MODES",
    "DATA_FORMATS",
    "INSTRUCTION_FORMATS",
    "DS_CONFIG_DIR",
    "EMBEDDED_CORPORA",
    "ENGINE_KINDS",
    "LORA_QUANTIZE",
    "BF16_WEIGHT_OPTIMIZERS",
    "OPTIMIZER_LIBRARY",
    "OPTIMIZER_NAMES",
    "PRECISIONS",
    "PRESETS",
    "PER_ROW_BASES",
    "PRUNE_BASES",
    "PRUNE_METHOD_FACTS",
    "PRUNE_METHODS",
    "MethodFacts",
    "CheckpointConfig",
    "CheckpointFormat",
    "ConfigError",
    "DataConfig",
    "EngineKind",
    "LoggingConfig",
    "LoraConfig",
    "MoeConfig",
    "aux_loss_coefficient",
    "MemoryConfig",
    "ParallelConfig",
    "ModelConfig",
    "OptimConfig",
    "Preset",
    "PruneConfig",
    "RunConfig",
    "Strategy",
    "adopt_settings",
    "all_keys",
    "apply_overrides",
    "check_optimizer_in_backward",
    "check_original",
    "check_method_keys",
    "check_prune_widths",
    "check_run",
    "SequenceLimit",
    "check_sequence_heads",
    "check_sequence_length",
    "sequence_limit",
    "check_expert_parallel",
    "check_sequence_parallel",
    "check_strategy_against_run",
    "checkpoint_format",
    "check_values",
    "config_to_dict",
    "default_lr",
    "freeze",
    "Section",
    "engine_kind",
    "given_in",
    "is_given",
    "is_original",
    "method_facts",
    "needs_calibration",
    "is_preset",
    "load_config",
    "load_strategy",
    "parse_yaml",
    "read_config_file",
    "resolve_prune",
    "row_score",
    "resolve_deepspeed_config",
]
