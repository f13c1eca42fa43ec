"""The model presets: names `model.name` accepts besides a local directory or hub id, each the
shape of a Llama built from its config with random init (harness.models builds them).

They are config vocabulary, like the embedded corpora: a preset is trained from scratch, so the
defaults that depend on what is trained (`harness.config.schema.default_lr`) read this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    vocab_size: int


PRESETS: dict[str, Preset] = {
    # A few hundred thousand parameters: fast enough for 2-rank tests on 2 cores.
    "tiny-llama": Preset(64, 176, 2, 4, 2, 512, 2048),
    # Small but not trivial: the CPU experiment matrix and pruning benchmark.
    "small-llama": Preset(256, 688, 4, 8, 4, 1024, 4096),
    # The pruning benchmark's: narrow and six blocks deep, so that trained on the whole standard
    # library (data.source=stdlib, ~10M tokens) pruning half its weights costs real perplexity.
    "bench-llama": Preset(128, 384, 6, 4, 4, 512, 2048),
    # The Peak Memory study's model: 32 layers, hidden 2048 (~1.6B with a 32k vocabulary).
    "llama-1.6b": Preset(2048, 5632, 32, 16, 16, 2048, 32000),
    # Llama-3-8B shape, for the planner's benchmark (never trained here).
    "llama3-8b": Preset(4096, 14336, 32, 32, 8, 8192, 128256),
    # Llama-3-70B shape, for the planner's memory ladder only (built on meta or fake storage, never trained here).
    "llama3-70b": Preset(8192, 28672, 80, 64, 8, 8192, 128256),
}


def is_preset(name: str) -> bool:
    return name in PRESETS
