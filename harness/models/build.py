"""Model construction: named presets with random init, or any HF causal LM by id or path.

Presets exist so that tests, benchmarks and the planner can build a model without
downloading anything. `tiny-llama` is the test model; `llama-1.6b` is the model of the
Peak Memory study (32 layers, hidden 2048).
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from harness.config import PRESETS, is_preset
from harness.models.packing import confine_packing
from harness.models.qlora import QuantizedWeights, quantize_empty, quantized_codes
from harness.models.weights import CheckpointWeights, InitWeights, WeightSource, fill, materialize


def preset_config(name: str, vocab_size: int | None = None, **overrides: Any):
    """A transformers LlamaConfig for a preset; `vocab_size` follows the tokenizer."""
    from transformers import LlamaConfig

    p = PRESETS[name]
    # a preset's fields are LlamaConfig's arguments of the same names
    kwargs = dict(asdict(p), vocab_size=vocab_size or p.vocab_size, tie_word_embeddings=False, attn_implementation="sdpa")
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def model_config(name_or_path: str, vocab_size: int | None = None, **overrides: Any):
    """The HF config of a preset, a local directory or a hub id (hub only if cached/online)."""
    if is_preset(name_or_path):
        return preset_config(name_or_path, vocab_size=vocab_size, **overrides)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def model_directory(name_or_path: str) -> str:
    """A local directory holding the checkpoint: the path itself, or the hub snapshot (weights
    as safetensors where the repository has them, else its ``.bin`` files)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.environ.get("HF_HUB_OFFLINE") == "1" and not os.path.exists(name_or_path):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
            raise FileNotFoundError(f"model '{name_or_path}' is not a preset or a local path and HF_HUB_OFFLINE=1")
    from huggingface_hub import list_repo_files, snapshot_download

    files = list_repo_files(name_or_path) if os.environ.get("HF_HUB_OFFLINE") != "1" else []
    weights = (
        ["*.safetensors", "*.safetensors.index.json"]
        if not files or any(f.endswith(".safetensors") for f in files)
        else ["*.bin", "*.bin.index.json"]
    )
    return snapshot_download(name_or_path, allow_patterns=["*.json", *weights])


def construct_model(config: Any) -> nn.Module:
    """The model built in the caller's context without any init (the weights are filled after):
    under DeepSpeed's `zero.Init` each parameter is partitioned as its module is created."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # transformers ties inside `init_weights`, which `no_init_weights` skips
    confine_packing(model)  # packed examples kept apart in decoders whose forward forgets the position ids
    model.train()
    return model


def empty_model(config: Any) -> nn.Module:
    """The model with its parameters on the meta device (no storage, no init) and real buffers
    (rotary frequencies are computed in the modules' constructors): the template every engine
    shards, or fills in place, before any parameter takes memory."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = construct_model(config)
    model.tie_weights()  # again outside: inside, accelerate re-registers the tied weight as a new meta parameter
    return model


@dataclass
class ModelSpec:
    """What to build: the model's config and where its weights come from."""

    name: str
    config: Any
    seed: int = 0
    directory: str | None = None  # the checkpoint; None: a preset's seeded random init

    def source(self, template: nn.Module) -> WeightSource:
        if self.directory is None:
            return InitWeights(template, self.seed)
        weights = CheckpointWeights(self.directory, getattr(template, "base_model_prefix", ""))
        weights.follow_conversions(template)
        return weights

    def fallback(self, template: nn.Module) -> InitWeights:
        """Init for what a checkpoint lacks (as transformers does: e.g. a head on a base model)."""
        return InitWeights(template, self.seed)


def model_spec(
    name_or_path: str, *, vocab_size: int | None = None, seed: int = 0, config_overrides: dict[str, Any] | None = None
) -> ModelSpec:
    """A preset (seeded random init) or a checkpoint (local directory or hub id)."""
    if is_preset(name_or_path):
        return ModelSpec(name_or_path, preset_config(name_or_path, vocab_size=vocab_size, **(config_overrides or {})), seed)
    directory = model_directory(name_or_path)
    return ModelSpec(name_or_path, model_config(directory, **(config_overrides or {})), seed, directory)


def twin_config(config: Any, layers: int) -> Any:
    """A copy of a model config with its first `layers` decoder blocks: the same architecture and
    widths. Per-layer lists in the config (`layer_types`) are cut to match."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = min(layers, config.num_hidden_layers)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    return config


def twin_spec(spec: ModelSpec, layers: int) -> ModelSpec:
    """A small twin of `spec` (`twin_config`) with the world-invariant seeded init (a checkpoint's
    weights are not read: the twin checks how a run computes, not what it starts from)."""
    return ModelSpec(spec.name, twin_config(spec.config, layers), spec.seed, None)


def build_model(
    name_or_path: str,
    *,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    quantize: str = "none",
) -> nn.Module:
    """The whole model in one process (the planner's measurement, export, tests): presets get the
    world-invariant seeded init, checkpoints their weights, both as a sharded engine would fill them.
    `quantize` (int8 | nf4): its linears quantized by bitsandbytes as a QLoRA run's are, computing
    in `dtype`; `qlora.dequantize` turns them back into plain linears holding what they encode.
    """
    spec = model_spec(name_or_path, vocab_size=vocab_size, seed=seed, config_overrides=config_overrides)
    return build_spec_model(spec, dtype, quantize)


def build_spec_model(spec: ModelSpec, dtype: torch.dtype = torch.float32, quantize: str = "none") -> nn.Module:
    """`build_model` of a spec already made (a run's, or its twin's)."""
    template = empty_model(spec.config)
    if quantize == "none":
        model = materialize(template, "cpu", dtype)
        fill(model, spec.source(template), fallback=spec.fallback(template))
        return model
    model = empty_model(spec.config).to(dtype=dtype)
    quantize_empty(model, quantize, dtype)
    weights = QuantizedWeights(spec.source(template), model, spec.fallback(template))
    fill(materialize(model, "cpu"), weights, fallback=spec.fallback(template))
    weights.attach(model)
    return model


def count_parameters(model: nn.Module) -> int:
    """Elements of every parameter; a quantized linear's weight counts the weights it encodes, not its packed codes."""
    codes = quantized_codes(model)
    return sum(codes.get(id(p), p.numel()) for p in model.parameters())
