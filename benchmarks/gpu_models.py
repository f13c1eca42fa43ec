"""The GPU suite's models and data: the ~323M Llama and llama-1.6b saved once as bf16 safetensors
(every run loads them by path instead of initialising them on the host), and their data caches,
prepared in the background while the GPU trains; the model maker run in a process of its own.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu_runs import tail, write_config


# ------------------------------------------------------------------ models and data, beforehand
def start_prep(ctx: Any) -> None:
    """Save both models (bf16 safetensors, once per machine) and prepare their data caches in the
    background, in the order the parts need them: the host does this while the GPU trains."""
    if ctx.sim or ctx.models:
        return
    for role in ("table", "tp"):
        ctx.models[role] = ctx.prep.submit(save_model, ctx, role)
        ctx.prep.submit(prepare_data, ctx, role)


def model_size(ctx: Any, role: str) -> str:
    return ctx.cfg["table_model" if role == "table" else "tp_model"]


def save_model(ctx: Any, role: str) -> Path | None:
    size = model_size(ctx, role)
    target = ctx.state.root / "models" / size
    key = "saved_model" if role == "table" else f"saved_model/{size}"
    if (target / "config.json").exists() and list(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cmd = [ctx.py, str(Path(__file__).resolve().with_name("gpu_suite.py")), "--make-model", str(target), "--size", size]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.cfg["model_timeout_s"], env=ctx.env(CUDA_VISIBLE_DEVICES=""))
        out, ok = proc.stdout + proc.stderr, proc.returncode == 0 and (target / "config.json").exists()
    except subprocess.TimeoutExpired:
        out, ok = f"timed out after {ctx.cfg['model_timeout_s']} s", False
    info = json.loads(proc.stdout.strip().splitlines()[-1]) if ok else {}
    if ok:  # the model's config travels back in results.json: plans can be made again on CPU beside the GPU's
        info["config_json"] = json.loads((target / "config.json").read_text())
    status = {"status": "ok"} if ok else {"status": "failed", "reason": "the model was not saved", "log_tail": tail(out)}
    ctx.state.item(key, dict(info, path=str(target), seconds=round(time.time() - t0, 1), **status))
    return target if ok else None


def prepare_data(ctx: Any, role: str) -> None:
    """`python -m harness.data` for the role's model and data (the cache key the runs will look up)."""
    model = ctx.models[role].result()
    if model is None:
        return
    data = ctx.cfg["table_data" if role == "table" else "tp_data"]
    work = ctx.runs / f"data_{role}"
    work.mkdir(parents=True, exist_ok=True)
    write_config(work / "config.json", {"model": {"name": str(model)}, "data": data})
    t0 = time.time()
    proc = subprocess.run(
        [ctx.py, "-m", "harness.data", "--config", str(work / "config.json")],
        capture_output=True,
        text=True,
        env=ctx.env(CUDA_VISIBLE_DEVICES=""),
        timeout=ctx.cfg["model_timeout_s"],
    )
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    status = "ok" if proc.returncode == 0 else "failed"
    ctx.state.item(
        f"data/{role}", {"status": status, "seconds": round(time.time() - t0, 1), "log_tail": tail(proc.stdout + proc.stderr, 800)}
    )


def model_for(ctx: Any, role: str) -> str | None:
    """The saved model's path (waiting for the background save), or None when it could not be saved."""
    if ctx.sim:
        return str(ctx.state.root / "models" / model_size(ctx, role))
    start_prep(ctx)
    try:
        path = ctx.models[role].result(timeout=max(1.0, ctx.remaining() - 20))
    except Exception as exc:
        print(f"[gpu_suite] model {role}: {type(exc).__name__}: {exc}", flush=True)
        return None
    return str(path) if path else None


# --------------------------------------------------------------------------------- model maker
SHAPES = {
    # ~323M parameters: 20 layers, hidden 1024, a 32k vocabulary (the GPU runs' tokenizer size)
    "300m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=16),
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}
VOCAB = {"300m": 32000, "tiny": 2048, "llama-1.6b": 32000, "tiny-llama": 2048}


def make_model(target: str, size: str) -> None:
    """Save a random-init Llama as bf16 safetensors with transformers, once: every run of that size then
    loads it by path (a sharded load for fsdp and zero3) instead of initialising it on the host."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if size in SHAPES:
        shape = dict(SHAPES[size], max_position_embeddings=2048, vocab_size=VOCAB[size])
        cfg = LlamaConfig(**shape, tie_word_embeddings=False, attn_implementation="sdpa")
    else:
        from harness.models import preset_config  # the harness's own shape for its preset names

        cfg = preset_config(size, vocab_size=VOCAB[size])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)  # bf16 on disk, as published checkpoints are
    model.save_pretrained(target, safe_serialization=True)
    files = sum(p.stat().st_size for p in Path(target).glob("*.safetensors"))
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params": params, "size": size, "dtype_on_disk": "bf16", "safetensors_bytes": files}))
