"""Models: presets built from a config, local or hub Hugging Face checkpoints, their weights read a
piece at a time (`weights`), where their decoder blocks are (the one lookup every technique uses),
and LoRA/QLoRA adapters (`lora`; QLoRA's quantized base: `qlora`)."""

from harness.config import PRESETS, Preset, is_preset
from harness.models.blocks import BlocksNotFound, block_class_names, decoder_block_list, decoder_blocks
from harness.models.build import (
    ModelSpec,
    build_model,
    construct_model,
    count_parameters,
    empty_model,
    model_config,
    model_directory,
    model_spec,
    preset_config,
)
from harness.models.lora import (
    LoraWeights,
    apply_lora,
    build_run_model,
    default_target_modules,
    empty_lora_model,
    init_adapters,
    resolve_target_modules,
    trainable_counts,
    wrap_peft,
)
from harness.models.qlora import QuantizedWeights, cast_except_quantized, dequantize, quant_state_tensors, quantize_empty, quantized_codes
from harness.models.weights import CheckpointWeights, InitWeights, Part, WeightSource, clean_name, fill, materialize, whole_part

__all__ = [
    "PRESETS",
    "QuantizedWeights",
    "LoraWeights",
    "BlocksNotFound",
    "CheckpointWeights",
    "InitWeights",
    "ModelSpec",
    "Part",
    "Preset",
    "WeightSource",
    "apply_lora",
    "block_class_names",
    "build_model",
    "build_run_model",
    "cast_except_quantized",
    "clean_name",
    "construct_model",
    "count_parameters",
    "decoder_block_list",
    "dequantize",
    "decoder_blocks",
    "default_target_modules",
    "empty_lora_model",
    "init_adapters",
    "empty_model",
    "fill",
    "is_preset",
    "quant_state_tensors",
    "quantize_empty",
    "quantized_codes",
    "materialize",
    "model_config",
    "model_directory",
    "model_spec",
    "preset_config",
    "resolve_target_modules",
    "trainable_counts",
    "whole_part",
    "wrap_peft",
]
