"""Model construction: named presets with random init, or any HF causal LM by id or path.

Presets exist so that tests, benchmarks and the planner can build a model without
downloading anything. `tiny-llama` is the test model; `llama-1.6b` is the model of the
Peak Memory study (32 layers, hidden 2048).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


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
    # The Peak Memory study's model: 32 layers, hidden 2048 (~1.6B with a 32k vocabulary).
    "llama-1.6b": Preset(2048, 5632, 32, 16, 16, 2048, 32000),
    # Llama-3-8B shape, for the planner's benchmark (never trained here).
    "llama3-8b": Preset(4096, 14336, 32, 32, 8, 8192, 128256),
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str, vocab_size: int | None = None, **overrides: Any):
    """A transformers LlamaConfig for a preset; `vocab_size` follows the tokenizer."""
    from transformers import LlamaConfig

    p = PRESETS[name]
    kwargs = dict(
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=p.max_position_embeddings,
        vocab_size=vocab_size or p.vocab_size,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def model_config(name_or_path: str, vocab_size: int | None = None):
    """The HF config of a preset, a local directory or a hub id (hub only if cached/online)."""
    if is_preset(name_or_path):
        return preset_config(name_or_path, vocab_size=vocab_size)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name_or_path)


def build_model(
    name_or_path: str,
    *,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """Build a causal LM. Presets get a seeded random init; paths/ids load weights.

    The seed makes the random init identical on every rank and every launcher, which is
    what lets a world-2 run be compared with a world-1 run step for step.
    """
    from transformers import AutoModelForCausalLM

    if is_preset(name_or_path):
        cfg = preset_config(name_or_path, vocab_size=vocab_size, **(config_overrides or {}))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        return model
    if not os.path.exists(name_or_path) and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"model '{name_or_path}' is not a preset or a local path and HF_HUB_OFFLINE=1")
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    model.train()  # from_pretrained returns eval mode (dropout off); a preset, and training, are in train mode
    if config_overrides:
        for key, value in config_overrides.items():
            setattr(model.config, key, value)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
