"""Two model families other than Llama through the user's entry point (`torchrun harness/train.py`,
2 gloo ranks): training with activation checkpointing, pruning, the end-of-run checkpoint
and the Hugging Face export, then `from_pretrained` on the export.

- GPT-NeoX (blocks at `gpt_neox.layers`, saved in bf16) under FSDP2: magnitude pruning of
  its decoder linears; the export holds the pruned weights (half of each is zero).
- Qwen2 (tied input/output embeddings) under ZeRO-3: the export loads with the head tied.

Both print and log the time to the first step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launching import launch_command, run, tiny_config
from model_families import save_families
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def families(tmp_path_factory, data_cache) -> tuple[dict[str, str], Path]:
    return save_families(tmp_path_factory.mktemp("family_models")), data_cache


def _train(tmp_path: Path, cache: Path, model_dir: str, **extra) -> tuple[Path, str]:
    out = tmp_path / "out"
    cfg = tiny_config(
        tmp_path / "run.yaml",
        cache,
        out,
        steps=2,
        **{"model.name": model_dir, "memory.activation_checkpointing": "full", "checkpoint.export_hf": True, **extra},
    )
    proc = run(launch_command("torchrun", 2, cfg, ["grad_accum=1"]), timeout=400)
    return out, proc.stdout


def _first_step_time(out: Path, stdout: str) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next(r for r in rows if r.get("kind") == "train")
    assert "time to first step:" in stdout and "load" in stdout.split("time to first step:")[1].splitlines()[0]
    return first["time/to_first_step_s"]


def test_gpt_neox_trains_prunes_and_exports_under_fsdp(families, tmp_path):
    dirs, cache = families
    out, stdout = _train(tmp_path, cache, dirs["gpt_neox"], strategy="fsdp", **{"prune.method": "magnitude", "prune.calib_samples": 8})
    assert _first_step_time(out, stdout) > 0
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    linears = {name: m.weight for name, m in model.gpt_neox.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 2 * 4  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h per block
    for name, weight in linears.items():
        assert float((weight == 0).float().mean()) == pytest.approx(0.5, abs=0.01), name


def test_qwen2_with_tied_embeddings_trains_and_exports_under_zero3(families, tmp_path):
    dirs, cache = families
    out, stdout = _train(tmp_path, cache, dirs["qwen2"], strategy="zero3")
    assert _first_step_time(out, stdout) > 0
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    start = AutoModelForCausalLM.from_pretrained(dirs["qwen2"])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one weight
    assert not torch.equal(model.model.embed_tokens.weight, start.model.embed_tokens.weight)  # and it was trained
