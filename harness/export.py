"""Export any checkpoint to a Hugging Face directory (safetensors + config + tokenizer).

One process, any checkpoint, no need for the world size that wrote it:

    python -m harness.export runs/x/checkpoints/step_00000100 --out runs/x/hf

Only model weights are read. From a DCP checkpoint we ask DCP for the `model.*` keys
alone (it reassembles each tensor from however many shards were written and never
touches the optimizer entries); from a DeepSpeed checkpoint we use DeepSpeed's own
`zero_to_fp32` consolidation (fp32 master weights, lazily loaded), or the module state of a
stage-0 checkpoint. The result is what `AutoModelForCausalLM.from_pretrained` loads.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

from harness.checkpoint_files import DS_TAG, CheckpointError, read_meta, remove_tree, resolve_checkpoint_path


def _empty_model(hf_config_dir: str) -> torch.nn.Module:
    """The architecture from the checkpoint's own config.json, with uninitialised CPU storage."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to_empty(device="cpu")


def _dcp_weights(path: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"), no_dist=True)
    return state["model"]


def _deepspeed_weights(path: str, zero_stage: int) -> dict[str, torch.Tensor]:
    ds_dir = os.path.join(path, "ds")
    if zero_stage == 0:  # no ZeRO partitions: the module state is whole in the model-states file
        states = torch.load(os.path.join(ds_dir, DS_TAG, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False)
        return {k: v.float() for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(ds_dir, tag=DS_TAG, lazy_mode=True)
    return {k: v.contiguous() for k, v in lazy.items()}


def consolidated_weights(path: str) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """Full fp32 weights of a checkpoint and an empty model of its architecture."""
    meta = read_meta(path)
    model = _empty_model(os.path.join(path, "hf_config"))
    weights = _dcp_weights(path, model) if meta.engine == "torch" else _deepspeed_weights(path, meta.zero_stage)
    return weights, model


def export_hf(checkpoint: str, out: str) -> str:
    """Write `out` (atomically: temp dir, then rename) from a checkpoint; returns `out`."""
    path = resolve_checkpoint_path(checkpoint)
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
    tmp = f"{out.rstrip(os.sep)}.tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    hf_files = os.path.join(path, "hf_config")
    for name in os.listdir(hf_files):  # tokenizer files (config.json came from save_pretrained)
        if name != "config.json" and os.path.isfile(os.path.join(hf_files, name)):
            shutil.copy2(os.path.join(hf_files, name), os.path.join(tmp, name))
    remove_tree(out)
    os.rename(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harness.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a step_* directory, a checkpoints/ directory or a run directory (its latest)")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    args = parser.parse_args(argv)
    try:
        out = export_hf(args.checkpoint, args.out)
    except CheckpointError as exc:
        print(f"harness.export: error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {resolve_checkpoint_path(args.checkpoint)} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
