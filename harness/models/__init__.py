"""Models: presets built from a config, local or hub Hugging Face checkpoints, and where their
decoder blocks are (the one lookup every technique uses)."""
from harness.models.blocks import decoder_block_list, decoder_blocks
from harness.models.build import PRESETS, Preset, build_model, count_parameters, is_preset, model_config, preset_config

__all__ = ["PRESETS", "Preset", "build_model", "count_parameters", "decoder_block_list", "decoder_blocks", "is_preset",
           "model_config", "preset_config"]
