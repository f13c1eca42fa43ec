"""Export of a LoRA checkpoint: the PEFT adapter directory, or a merged full model.

A LoRA checkpoint holds the adapters only (`Engine.trainable_only`); the frozen base is
rebuilt the way the run built it (`harness.models.build_run_model`: the preset's seeded
init or the model directory); a QLoRA base is quantized as the run quantized it (bitsandbytes
is deterministic) and dequantized, so a merged QLoRA model is the function the run trained:
the 4-bit base's weights plus the adapters, as plain linears. The adapters are read by the engine that wrote them
(`harness.engine.read_model_weights`), loaded into the rebuilt model, and then written by
peft itself:

- adapter directory (default): `PeftModel.save_pretrained` -> `adapter_config.json` +
  `adapter_model.safetensors`, loadable with `PeftModel.from_pretrained(base, dir)`;
- merged (`--merged`): `merge_and_unload()` -> a plain HF model directory that
  `AutoModelForCausalLM.from_pretrained` loads, with no peft needed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

from harness.checkpoint.layout import CheckpointMeta
from harness.config import LoraConfig, RunConfig
from harness.engine import read_model_weights
from harness.errors import CheckpointError
from harness.models import build_model, dequantize, resolve_targets, wrap_peft


def is_lora_checkpoint(meta: CheckpointMeta) -> bool:
    return bool(meta.config.get("lora", {}).get("enabled"))


def lora_config_of(meta: CheckpointMeta) -> LoraConfig:
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    return LoraConfig(**{k: v for k, v in meta.config.get("lora", {}).items() if k in known})


def export_lora(path: str, meta: CheckpointMeta, tmp: str, merged: bool) -> None:
    """Write the adapter directory (or, `merged`, the merged model) of checkpoint `path` into `tmp`."""
    with open(os.path.join(path, "hf_config", "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    model_cfg = meta.config.get("model", {})
    lora = lora_config_of(meta)
    seed = int(model_cfg.get("seed", RunConfig().model.seed))
    base = build_model(meta.model, vocab_size=vocab, seed=seed, quantize=lora.quantize)
    if lora.quantize != "none":  # the quantized base the adapters were trained on, dequantized: plain linears
        base = dequantize(base)
        lora = dataclasses.replace(lora, quantize="none")
    peft_model = wrap_peft(base, lora, resolve_targets(base, lora, quiet=True), seed=int(model_cfg.get("seed", 0)))
    inner = peft_model.base_model.model
    weights = read_model_weights(path, meta.engine, meta.zero_stage, inner, trainable_only=True)
    trainable = {name for name, p in inner.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(weights))
    unexpected = sorted(set(weights) - set(inner.state_dict()))
    if missing or unexpected:
        raise CheckpointError(f"{path}: adapters do not match the run's LoRA config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    bad = [k for k, v in weights.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{path}: {len(bad)} adapter tensors are not finite (first: {bad[0]}); refusing to export")
    with torch.no_grad():
        params = dict(inner.named_parameters())
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].dtype))
    peft_model.peft_config["default"].base_model_name_or_path = meta.model
    if merged:
        peft_model.merge_and_unload().save_pretrained(tmp, safe_serialization=True)
    else:
        peft_model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)  # no hub lookup of the base
    hf_files = os.path.join(path, "hf_config")
    for name in os.listdir(hf_files):  # tokenizer files (and, for the adapter directory, the base's config for reference)
        target = os.path.join(tmp, name if name != "config.json" or merged else "base_config.json")
        if os.path.isfile(os.path.join(hf_files, name)) and not os.path.exists(target):
            shutil.copy2(os.path.join(hf_files, name), target)
