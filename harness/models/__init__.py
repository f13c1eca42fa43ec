"""Models: presets built from a config, local or hub Hugging Face checkpoints, their weights read a
piece at a time (`weights`), and where their decoder blocks are (the one lookup every technique uses)."""
from harness.models.blocks import BlocksNotFound, block_class_names, decoder_block_list, decoder_blocks
from harness.models.build import (
    PRESETS,
    ModelSpec,
    Preset,
    build_model,
    construct_model,
    count_parameters,
    empty_model,
    is_preset,
    model_config,
    model_directory,
    model_spec,
    preset_config,
)
from harness.models.weights import CheckpointWeights, InitWeights, WeightSource, clean_name, fill, materialize, whole_part

__all__ = ["PRESETS", "BlocksNotFound", "CheckpointWeights", "InitWeights", "ModelSpec", "Preset", "WeightSource", "block_class_names",
           "build_model", "clean_name", "construct_model", "count_parameters", "decoder_block_list", "decoder_blocks", "empty_model",
           "fill", "is_preset", "materialize", "model_config", "model_directory", "model_spec", "preset_config", "whole_part"]
