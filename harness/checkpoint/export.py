"""Export any checkpoint to a Hugging Face directory (safetensors + config + tokenizer).

One process, any checkpoint, no need for the world size that wrote it:

    python -m harness.export runs/x/checkpoints/step_00000100 --out runs/x/hf

Only model weights are read, by the engine that wrote the checkpoint
(`harness.engine.read_model_weights`). The result is what
`AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import os
import shutil

import torch

from harness.checkpoint.layout import read_meta, remove_tree, resolve_checkpoint_path
from harness.checkpoint.lora_export import export_lora, is_lora_checkpoint
from harness.checkpoint.outdir import check_export_target, commit_export, new_export_dir
from harness.engine import read_model_weights
from harness.errors import CheckpointError
from harness.models import clean_name, drop_experts, empty_model, materialize, model_config


def consolidated_weights(path: str) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """Full fp32 weights of a checkpoint (by the model's own names: DeepSpeed saves them as the
    module it wrapped had them, activation-checkpoint wrappers included) and the architecture
    from the checkpoint's config.json with uninitialised CPU storage."""
    meta = read_meta(path)
    model = materialize(empty_model(model_config(os.path.join(path, "hf_config"))), "cpu")
    weights = read_model_weights(path, meta.engine, meta.zero_stage, model)
    return {clean_name(k): v for k, v in weights.items()}, model


def export_hf(checkpoint: str, out: str, merged: bool = False, overwrite: bool = False, flag: str = "--overwrite") -> str:
    """Write `out` (atomically: a fresh temp dir, then rename) from a checkpoint; returns `out`. A
    LoRA checkpoint gives its PEFT adapter directory, or with `merged` the merged full model.
    `out` may replace only an earlier harness export, and only with `overwrite`
    (`harness.checkpoint.outdir`); ConfigError before anything is read otherwise."""
    path = resolve_checkpoint_path(checkpoint)
    check_export_target(out, path, overwrite, flag)
    meta = read_meta(path)
    tmp = new_export_dir(out)
    try:
        if is_lora_checkpoint(meta):
            export_lora(path, meta, tmp, merged)
        else:
            _export_full(path, tmp)
    except BaseException:
        remove_tree(tmp)
        raise
    commit_export(tmp, out, path, overwrite, flag)
    return out


def _export_full(path: str, tmp: str) -> None:
    weights, model = consolidated_weights(path)
    bad = [k for k, v in weights.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{path}: {len(bad)} tensors are not finite (first: {bad[0]}); refusing to export")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the saved architecture (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    kept = read_meta(path).kept_experts
    if kept:  # expert pruning's choice: the smaller model, router rows and all
        drop_experts(model, kept)
    model.save_pretrained(tmp, safe_serialization=True)
    hf_files = os.path.join(path, "hf_config")
    for name in os.listdir(hf_files):  # tokenizer files (config.json came from save_pretrained)
        if name != "config.json" and os.path.isfile(os.path.join(hf_files, name)):
            shutil.copy2(os.path.join(hf_files, name), os.path.join(tmp, name))
