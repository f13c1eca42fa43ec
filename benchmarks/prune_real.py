"""The pruning benchmark on a real pretrained model: SmolLM2-135M (`prune_bench.py --model smollm2-135m`).

What this module adds to `prune_bench.py`:

- `real_config`: the run config (the model prepared by `real_model.py`, its own tokenizer, the
  embedded corpus at seq 256). Nothing is trained: the pretrained weights are pruned as loaded.
- `disjointness`: the proof that calibration and eval share no document. The data cache
  writes each split's documents in order (`<split>.bin`) with their start offsets
  (`<split>.docs.npy`); every whole document that a drawn calibration block or any eval block
  touches is hashed (sha256 of its token ids), and the two sets must not intersect. A document
  is assigned to its split by a hash of its content, so identical documents always land in the
  same split: an empty intersection means no text of eval was ever calibrated on.
- `finetune_world2`: prune -> masked fine-tune -> HF export as one command
  (`torchrun --nproc_per_node=2 -m harness.prune strategy=fsdp prune.finetune_steps=N`), then the
  exported directory loaded by transformers and compared, weight by weight, with the saved masks.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import real_model  # noqa: E402

from harness.distributed import Collectives  # noqa: E402
from harness.pruning import MaskSet, build_views, calibration_samples  # noqa: E402

MODEL = "smollm2-135m"


def real_config(work: Path, calib: int, seq_len: int, eval_batches: int, calib_fraction: float = 0.10) -> dict[str, Any]:
    """SmolLM2-135M as loaded (fp32, dequantized from Q4_1: see real_model.py) on the embedded
    corpus tokenized by its own tokenizer; eval = the first `eval_batches` x 4 blocks of the eval split.
    A larger `calib_fraction` makes room for more calibration samples (512 needs ~0.2); it moves
    documents from train to calib only, so eval is unchanged and the results cache stamp differs."""
    return {
        "model": {"name": str(real_model.prepare())},
        # calib_fraction 0.10 (default 0.05): 317 calibration blocks of 256, room for 256 samples and a
        # 32-block holdout; the eval split is the same documents at any calib_fraction (split_of).
        "data": {"source": "embedded", "seq_len": seq_len, "calib_fraction": calib_fraction, "cache_dir": str(work / "cache")},
        "micro_batch_size": 4,
        "grad_accum": 1,
        "steps": 1,
        "eval_batches": eval_batches,
        "eval_every": 1000,
        "logging": {"wandb": False, "progress": False, "plots": False},
        "memory": {"track": False},
        "prune": {"calib_samples": calib, "sparsity": 0.5},
        "output_dir": str(work / "dense"),
    }


def model_stamp(hf_dir: str, cfg_dict: dict[str, Any]) -> str:
    """A short hash of the model's weights and of everything but `prune` in the config: cached
    pruning runs belong to this model, data and eval set."""
    h = hashlib.sha256(json.dumps({k: v for k, v in cfg_dict.items() if k != "prune"}, sort_keys=True).encode())
    with (Path(hf_dir) / "model.safetensors").open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:12]


def _documents(cache: str, split: str, blocks: np.ndarray, block_ids: np.ndarray) -> set[str]:
    """sha256 of every whole document (its token ids) that the given blocks of `split` touch.
    Also checks that each block is the split's stream at its offset (what the hashes describe)."""
    seq = blocks.shape[1]
    flat = np.memmap(os.path.join(cache, f"{split}.bin"), dtype=blocks.dtype, mode="r")
    starts = np.load(os.path.join(cache, f"{split}.docs.npy"))
    ends = np.append(starts[1:], flat.shape[0])
    out = set()
    starts_at = getattr(blocks, "starts", None)  # BOS-first blocks (`harness.data.blocks.BosBlocks`) start where they say
    for b in block_ids.tolist():
        lo = int(starts_at[b]) if starts_at is not None else b * seq
        taken = seq - (starts_at is not None and int(flat[lo]) != blocks.bos)  # a BOS put before it takes one token less
        hi = lo + taken
        if not np.array_equal(np.asarray(flat[lo:hi]), np.asarray(blocks[b])[seq - taken :]):
            raise AssertionError(f"{split} block {b} is not the stream at offset {lo}")
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        last = int(np.searchsorted(starts, hi, side="left"))  # documents starting before the block ends
        for d in range(first, last):
            out.add(hashlib.sha256(np.asarray(flat[starts[d] : ends[d]], dtype=np.int64).tobytes()).hexdigest())
    return out


def disjointness(data: Any, calib_sizes: list[int], seeds: list[int]) -> dict[str, Any]:
    """Documents of the drawn calibration blocks (every calib size x seed used) vs every eval
    block: counts and the size of the intersection, which must be 0."""
    n_calib = data.blocks["calib"].shape[0]
    ids: set[int] = set()
    for n in calib_sizes:
        for s in seeds:
            ids |= set(calibration_samples(torch.arange(n_calib)[:, None], min(n, n_calib), s)[:, 0].tolist())
    calib_docs = _documents(data.cache_dir, "calib", data.blocks["calib"], np.array(sorted(ids)))
    eval_docs = _documents(data.cache_dir, "eval", data.blocks["eval"], np.arange(data.blocks["eval"].shape[0]))
    shared = calib_docs & eval_docs
    out = {
        "calib_blocks_drawn": len(ids),
        "calib_blocks_in_split": int(n_calib),
        "calib_documents_touched": len(calib_docs),
        "eval_blocks": int(data.blocks["eval"].shape[0]),
        "eval_documents_touched": len(eval_docs),
        "shared_documents": len(shared),
        "calib_documents_sha256": hashlib.sha256("".join(sorted(calib_docs)).encode()).hexdigest()[:16],
        "eval_documents_sha256": hashlib.sha256("".join(sorted(eval_docs)).encode()).hexdigest()[:16],
    }
    if shared:
        raise AssertionError(f"calibration and eval share {len(shared)} documents: {out}")
    return out


def _env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def exported_vs_masks(hf_dir: Path, masks_dir: Path, targets: str) -> dict[str, Any]:
    """Load the exported model with transformers and compare each target weight's zeros with
    the saved masks (loaded at world 1, whatever world size saved them)."""
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    comm = Collectives()
    views = build_views(model, targets, comm)
    masks = MaskSet.load(str(masks_dir), views, comm)
    masked = nonzero_masked = extra_zeros = numel = 0
    for v in views:
        zero = v.param.detach().reshape(-1) == 0
        m = masks.masks[v.name]
        masked += int(m.sum())
        nonzero_masked += int((m & ~zero).sum())
        extra_zeros += int((zero & ~m).sum())
        numel += v.numel
    return {
        "loaded_class": type(model).__name__,
        "target_numel": numel,
        "masked": masked,
        "mask_sparsity": masked / numel,
        "masked_but_nonzero": nonzero_masked,
        "zero_but_unmasked": extra_zeros,
    }


def finetune_world2(
    work: Path, cfg_dict: dict[str, Any], method: str, pattern: str, steps: int, lr: float, micro_batch: int, eval_every: int = 0
) -> dict[str, Any]:
    """Prune -> masked fine-tune -> export under FSDP2 at world 2, the command users run; then the
    export checked against the masks. Returns the command's numbers and the check; `eval_every`
    (0: at the end only) adds the recovery curve, eval perplexity after every that many steps.

    `method="dense"`: the baseline a recovery is judged against, the unpruned model fine-tuned the
    same way (`harness.train`, same data order, schedule and eval set): fine-tuning on this corpus
    lowers the dense perplexity too, so "back within 10% of dense" is read against both."""
    dense = method == "dense"
    out = work / f"ft_w2_{method}_{pattern.replace(':', '')}_{steps}"
    path = work / f"{out.name}.yaml"
    cfg = {
        **cfg_dict,
        "strategy": "fsdp",
        "micro_batch_size": micro_batch,
        "eval_every": eval_every or cfg_dict["eval_every"],
        "output_dir": str(out),
        "checkpoint": {"overwrite": True},
        "optim": {"lr": lr, "warmup_steps": max(1, steps // 10)},
        "prune": {
            **cfg_dict["prune"],
            "method": method,
            **({"decision": "veto"} if method == "gradprobe" else {}),  # the veto, as measured in notes/pruning.md
            "pattern": pattern,
            "calib_seed": 0,
            "finetune_steps": steps,
        },
    }
    if dense:  # no prune keys at all: harness.train refuses prune settings without a method
        del cfg["prune"]
        cfg["steps"] = steps
    path.write_text(yaml.safe_dump(cfg))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    entry = "harness.train" if dense else "harness.prune"
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={port}", "-m", entry, "--config", str(path)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    if dense:
        return {
            "command": " ".join(["torchrun --nproc_per_node=2 -m harness.train --config", path.name]),
            "strategy": "fsdp",
            "method": "dense",
            "finetune_steps": steps,
            "lr": lr,
            "micro_batch_size_per_rank": micro_batch,
            "eval_sequences": cfg_dict["eval_batches"] * micro_batch,
            "eval_perplexity_finetuned": evals[-1]["eval/perplexity"],
            "curve": [[r["step"], r["eval/perplexity"]] for r in evals],
            "train_losses": losses,
            "command_wall_s": wall,
        }
    report = json.loads((out / "prune_report.json").read_text())
    return {
        "command": " ".join(["torchrun --nproc_per_node=2 -m harness.prune --config", path.name]),
        "strategy": "fsdp",
        "world_size": report.get("world_size", 2),
        "method": method,
        "pattern": pattern,
        "finetune_steps": steps,
        "lr": lr,
        "micro_batch_size_per_rank": micro_batch,
        "calib_samples": cfg_dict["prune"]["calib_samples"],
        "eval_sequences": cfg_dict["eval_batches"] * micro_batch,  # the first blocks of the eval split
        "eval_perplexity_before": report["eval_perplexity_before"],
        "eval_perplexity_pruned": report["eval_perplexity_after"],
        "eval_perplexity_finetuned": evals[-1]["eval/perplexity"],
        "curve": [[0, report["eval_perplexity_after"]], *[[r["step"], r["eval/perplexity"]] for r in evals if r["step"] > 0]],
        "train_losses": losses,
        "achieved_sparsity": report["achieved_sparsity"],
        "prune_wall_time_s": report.get("wall_time_s"),
        "peak_probe_bytes_per_rank": report.get("peak_probe_bytes"),
        "command_wall_s": wall,
        "export_check": exported_vs_masks(out / "hf", out / "prune_masks", cfg_dict.get("prune", {}).get("targets", "decoder_linears")),
    }
