"""Models: presets built from a config, local or hub Hugging Face checkpoints, where their
decoder blocks are (the one lookup every technique uses), and LoRA/QLoRA adapters (`lora`)."""
from harness.models.blocks import decoder_block_list, decoder_blocks
from harness.models.build import PRESETS, Preset, build_model, count_parameters, is_preset, model_config, preset_config
from harness.models.lora import (
    apply_lora,
    build_run_model,
    default_target_modules,
    is_quantized,
    load_quantized_base,
    resolve_target_modules,
    trainable_counts,
    wrap_peft,
)

__all__ = ["PRESETS", "Preset", "apply_lora", "build_model", "build_run_model", "count_parameters", "decoder_block_list",
           "decoder_blocks", "default_target_modules", "is_preset", "is_quantized", "load_quantized_base", "model_config",
           "preset_config", "resolve_target_modules", "trainable_counts", "wrap_peft"]
