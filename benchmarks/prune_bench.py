"""Pruning benchmark: magnitude, Wanda, SparseGPT and GradProbe (and what GradProbe is made of)
on a model that pruning actually hurts.

    OMP_NUM_THREADS=1 python benchmarks/prune_bench.py --work runs/prune_bench

1. Trains `bench-llama` (6 blocks, hidden 128; 1.3M parameters in the pruned decoder Linears)
   on `data.source=stdlib` (the whole standard library, ~10M tokens with the local 2048-token
   BPE) with `python -m harness.train`, long enough that 50% magnitude pruning costs well over
   20% perplexity, and exports it (cached in `--work`: a second run with the same settings
   reuses it).
2. In one process (world 1, the trainer's own engine built by `harness.runner.build_run`),
   restores the dense weights before every run and calls the pruning stage
   (`harness.runner.prune_and_measure`, the stage's pruning without saving or enforcing) for each
   variant x pattern x calibration seed.
   Calibration samples come from the `calib` split; perplexity is measured on the `eval`
   split, which calibration never reads. Nothing is tuned on eval.
3. The masked fine-tune column: `python -m harness.prune ... prune.finetune_steps=N` per
   method (seed 0), the command users run.
4. `--world2`: GradProbe's cost per rank at world 2 (FSDP2, torchrun), K=1 and K=all.

Writes `benchmarks/results/pruning/results.json` (`dense_ppl`, `ppl[method][pattern]` means over seeds,
their sd, every run) and `<work>/table.md` (the table for notes/pruning.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (by prune_real)

import prune_real  # noqa: E402
import yaml  # noqa: E402
from safetensors import safe_open  # noqa: E402

# (key in results.json, label in the table, prune overrides). Every row runs at 50% unstructured
# and 2:4 for each calibration seed (magnitude reads no calibration data: one seed). GradProbe's
# rows with pool=0 have a candidate pool equal to the target: the probe cannot change the base's
# choice, so they measure the base score alone (the gradient bases still need G0's pass). Every
# GradProbe row names its decision. Every method at its defaults, on real models: prune_compare.py.
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("magnitude", "magnitude", {"method": "magnitude"}),
    ("wanda", "wanda", {"method": "wanda"}),
    ("sparsegpt", "sparsegpt", {"method": "sparsegpt"}),
    ("gradprobe", "gradprobe veto (the first default)", {"method": "gradprobe", "decision": "veto"}),
    ("gradprobe_rank_wanda", "gradprobe rank, wanda base", {"method": "gradprobe", "base": "wanda", "decision": "rank"}),
    ("gradprobe_veto_wanda", "gradprobe veto, wanda base", {"method": "gradprobe", "base": "wanda", "decision": "veto"}),
    ("score_taylor", "score alone: taylor |W|·‖G‖", {"method": "gradprobe", "base": "taylor", "decision": "veto", "pool": 0.0}),
    ("score_gblm", "score alone: gblm |W|·‖X‖ + |W|·‖G‖", {"method": "gradprobe", "base": "gblm", "decision": "veto", "pool": 0.0}),
    ("score_ria", "score alone: ria", {"method": "gradprobe", "base": "ria", "decision": "veto", "pool": 0.0}),
    ("gradprobe_rank_gblm", "gradprobe rank, gblm base", {"method": "gradprobe", "base": "gblm", "decision": "rank"}),
    ("gradprobe_veto_gblm", "gradprobe veto, gblm base", {"method": "gradprobe", "base": "gblm", "decision": "veto"}),
    ("gradprobe_veto_ria", "gradprobe veto, ria base", {"method": "gradprobe", "base": "ria", "decision": "veto"}),
    ("gradprobe_saliency_wanda", "gradprobe saliency, wanda base", {"method": "gradprobe", "base": "wanda", "decision": "saliency"}),
    (
        "gradprobe_saliency_wanda_pool1",
        "gradprobe saliency, wanda base, pool 1.0",
        {"method": "gradprobe", "base": "wanda", "decision": "saliency", "pool": 1.0},
    ),
    ("gradprobe_saliency_gblm", "gradprobe saliency, gblm base", {"method": "gradprobe", "base": "gblm", "decision": "saliency"}),
    # The probe as a local measurement: shrink the pool by 10% instead of to 10%
    (
        "gradprobe_saliency_wanda_r09",
        "gradprobe saliency, wanda base, reduction 0.9",
        {"method": "gradprobe", "base": "wanda", "decision": "saliency", "reduction": 0.9},
    ),
    (
        "gradprobe_rank_wanda_r09",
        "gradprobe rank, wanda base, reduction 0.9",
        {"method": "gradprobe", "base": "wanda", "decision": "rank", "reduction": 0.9},
    ),
    (
        "gradprobe_veto_wanda_r09",
        "gradprobe veto, wanda base, reduction 0.9",
        {"method": "gradprobe", "base": "wanda", "decision": "veto", "reduction": 0.9},
    ),
    # OWL sets each block's unstructured sparsity: unstructured rows only
    ("wanda_owl", "wanda + OWL allocation", {"method": "wanda", "allocation": "owl"}),
    (
        "gradprobe_saliency_wanda_owl",
        "gradprobe saliency, wanda base + OWL allocation",
        {"method": "gradprobe", "base": "wanda", "decision": "saliency", "allocation": "owl"},
    ),
]
PATTERNS = [("unstructured_50", "unstructured"), ("2:4", "2:4")]
FINETUNED = ["magnitude", "wanda", "sparsegpt", "gradprobe"]  # the masked fine-tune column (seed 0)
ORIGINAL = "gradprobe_original"  # the reference's streaming veto: undershoots the target
MATCHED = "wanda_at_original_sparsity"
CONTROL = "control_random_in_wanda_pool"
LABELS = {key: label for key, label, _ in VARIANTS} | {
    ORIGINAL: "gradprobe original (streaming, global magnitude candidates, veto, fp32)",
    MATCHED: "wanda at the original's achieved sparsity",
    CONTROL: "control: random choice in GradProbe's Wanda pool",
}


def random_pool_control(engine: Any, data: Any, cfg: Any, info: Any, pattern: str, seed: int) -> dict[str, Any]:
    """What exact-target GradProbe would score if its gradient ranking were noise: the same
    candidate pool (Wanda at sparsity x (1 + pool); 2:4: the 3 lowest of each 4), the same
    pruned count per row / group, chosen uniformly at random (seeded). World 1 only."""
    import torch

    from harness.distributed import Collectives
    from harness.pruning import build_views, restore_views, run_pruning, snapshot_views
    from harness.runner import calibration_batches, calibration_split, evaluate

    p = cfg.prune
    pool_cfg = dataclasses.replace(
        p,
        method="wanda",
        calib_seed=seed,
        pattern="1:4" if pattern == "2:4" else pattern,
        sparsity=0.75 if pattern == "2:4" else p.sparsity * (1 + p.pool),
    )
    samples, _ = calibration_split(data, dataclasses.replace(cfg, prune=pool_cfg))
    batches = calibration_batches(samples, cfg, info, Collectives())
    views = build_views(engine.model, p.targets, Collectives())
    dense = snapshot_views(views)  # the pool's masks only: its weights are put back
    report = run_pruning(engine.model, batches, pool_cfg, lambda _, b: engine.forward_loss(b), grad_accum=cfg.grad_accum)
    restore_views(views, dense, Collectives())
    del dense
    g = torch.Generator().manual_seed(1000 + seed)
    pruned = total = 0
    with torch.no_grad():
        for v in build_views(engine.model, p.targets, Collectives()):
            pool = report.masks[v.name].reshape(v.rows, v.cols)
            width, k = (4, 2) if pattern == "2:4" else (v.cols, int(v.cols * p.sparsity))  # Wanda's per-row count
            noise = torch.rand(v.rows, v.cols, generator=g).masked_fill(~pool, float("inf")).reshape(v.rows, -1, width)
            chosen = torch.zeros_like(noise, dtype=torch.bool).scatter_(-1, noise.topk(k, dim=-1, largest=False).indices, True)
            v.param.data[chosen.reshape(v.rows, v.cols)] = 0
            pruned, total = pruned + int(chosen.sum()), total + v.numel
    return {
        "eval_perplexity_after": evaluate(engine, data, cfg, info)["eval/perplexity"],
        "achieved_sparsity": pruned / total,
        "fwd_passes": report.fwd_passes,
        "fwd_bwd_passes": 0.0,
        "group_size": report.group_size,
        "groups": report.groups,
        "peak_probe_bytes": report.peak_probe_bytes,
        "wall_time_s": report.wall_time_s,
        "target_numel": total,
    }


def base_config(work: Path, steps: int, calib: int) -> dict[str, Any]:
    """One config for training and pruning: the eval set is the same blocks in both.

    The model is trained long enough on enough text (`bench-llama`, 1.3M parameters in its
    pruned Linears, on the whole standard library) that pruning half its weights by magnitude
    costs well over 20% perplexity: a model that barely notices pruning cannot rank methods."""
    return {
        "model": {"name": "bench-llama", "seed": 0},
        "data": {"source": "stdlib", "seq_len": 128, "max_tokens": None, "cache_dir": str(work / "cache")},
        "micro_batch_size": 16,
        "grad_accum": 1,
        "steps": steps,
        "eval_batches": 25,
        "eval_every": 1000,
        "optim": {"lr": 3e-3, "warmup_steps": 200, "schedule": "cosine", "min_lr_ratio": 0.1, "weight_decay": 0.1},
        "logging": {"wandb": False, "progress": False, "plots": False},
        "memory": {"track": False},
        "prune": {"calib_samples": calib, "sparsity": 0.5},
        "output_dir": str(work / "dense"),
    }


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS=e.get("OMP_NUM_THREADS", "1"), WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def trained_stamp(work: Path) -> str:
    """A short hash of the trained model's weights file: cached pruning runs belong to it."""
    with (work / "dense" / "hf" / "model.safetensors").open("rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


SWEPT = ["wanda", "sparsegpt", "gradprobe"]  # the calibration size sweep's methods (seed 0)


def train_dense(work: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train + export once; reused while the training settings are unchanged."""
    stamp = work / "dense.json"
    key = {k: v for k, v in cfg.items() if k != "prune"}
    hf = work / "dense" / "hf"
    if stamp.exists() and (hf / "model.safetensors").exists():
        saved = json.loads(stamp.read_text())
        if saved["config"] == key:
            print(f"[bench] reusing the trained model in {hf}", file=sys.stderr, flush=True)
            return saved
    work.mkdir(parents=True, exist_ok=True)
    path = work / "train.yaml"
    # no prune section: prune keys without prune.method are refused (they would do nothing in training).
    # data.calib_fraction written: a run that does not prune holds out no calibration split unless told,
    # and the dense model must never train on the documents the pruning runs calibrate on.
    from harness.config import DataConfig

    data = {**key["data"], "calib_fraction": DataConfig.calib_fraction}
    path.write_text(yaml.safe_dump({**key, "data": data, "checkpoint": {"export_hf": True, "overwrite": True}}))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "harness.train", "--config", str(path)], cwd=REPO, env=env(), check=True, stdout=subprocess.DEVNULL
    )
    rows = [json.loads(x) for x in (work / "dense" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if r["kind"] == "eval"]
    out = {
        "config": key,
        "wall_s": time.perf_counter() - t0,
        "eval_perplexity": evals[-1]["eval/perplexity"],
        "final_train_loss": [r for r in rows if "train/loss" in r][-1]["train/loss"],
        "hf": str(hf),
    }
    stamp.write_text(json.dumps(out, indent=1))
    return out


def prune_in_process(
    work: Path,
    cfg_dict: dict[str, Any],
    hf: str,
    seeds: list[int],
    only: list[str] | None,
    stamp: str | None = None,
    sweep: list[int] | None = None,
    holdout: bool = True,
    cached_only: bool = False,
    patterns: list[tuple[str, str]] | None = None,
    holdout_tail: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every variant x pattern x seed on one engine, dense weights restored before each run.

    `stamp` names the run cache (default: the trained model's hash); `sweep`: calibration sizes
    run for the SWEPT methods at seed `seeds[0]` besides the configured one (rows with `sweep: True`);
    `holdout=False` skips the calib-holdout perplexity (one more evaluation per run); `cached_only`
    reports the runs an earlier call finished and lists the others in `dense["not_run"]`;
    `patterns`: a subset of PATTERNS; `holdout_tail`: the holdout is the last eval-sized stretch
    of the seed's calib permutation, the same blocks at every calibration size (the sweep compares
    sizes on it), instead of the blocks right after the drawn ones."""
    patterns = patterns or PATTERNS
    import torch

    from harness import distributed as dist_utils
    from harness.config import load_config, load_strategy
    from harness.data import load_packed, prepare_data
    from harness.distributed import Collectives
    from harness.runner import HOLDOUT_SPLIT, build_run, calibration_split, evaluate, preflight, prune_and_measure

    def holdout_perplexity(prune: Any) -> float:
        """Perplexity on the calib blocks this seed did not draw: what a user could select a
        method on without touching eval (the defaults were chosen on it, never on eval)."""
        _, holdout = calibration_split(data, dataclasses.replace(cfg, prune=prune))
        if holdout_tail:
            holdout = holdout[-cfg.eval_batches * cfg.micro_batch_size :]
        val = dataclasses.replace(data, blocks={**data.blocks, HOLDOUT_SPLIT: holdout})
        return evaluate(engine, val, cfg, info, split=HOLDOUT_SPLIT)["eval/perplexity"]

    path = work / "prune.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **cfg_dict,
                "model": {"name": hf},
                "steps": 1,
                "output_dir": str(work / "prune_w1"),
                "checkpoint": {"overwrite": True},
                # each run replaces the method; the decision (read by gradprobe only, whose rows name theirs)
                # stays the veto, the default when the cached runs were made, so their cache keys still match
                "prune": {**cfg_dict["prune"], "method": "wanda", "decision": "veto"},
            }
        )
    )
    cfg = load_config(str(path), ["strategy=ddp"])
    stamp = stamp or trained_stamp(work)
    dense_path = work / f"dense-{stamp}.json"  # the dense model's numbers, per calibration seed
    if cached_only:  # no engine: the data cache, and the dense numbers an earlier call measured
        data = load_packed(prepare_data(cfg.model.name, cfg.data, progress=False))
        dense = json.loads(dense_path.read_text())
        with safe_open(str(Path(hf) / "model.safetensors"), framework="pt") as f:
            params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    else:
        info = dist_utils.init_distributed(cfg.device)
        loop, _ = build_run(cfg, preflight(cfg, load_strategy("ddp")), info)
        engine, data = loop.engine, loop.data
        dense_state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        params = sum(p.numel() for p in engine.module.parameters())
        dense = json.loads(dense_path.read_text()) if dense_path.exists() else evaluate(engine, data, cfg, info)
        dense["params"] = params
    held = {str(k): v for k, v in dense.get("holdout_perplexity", {}).items()}
    for s in seeds if holdout and not cached_only else []:
        if str(s) not in held:
            held[str(s)] = holdout_perplexity(dataclasses.replace(cfg.prune, calib_seed=s))
    dense["holdout_perplexity"] = held
    dense_path.write_text(json.dumps(dense))
    base_n = cfg.prune.calib_samples
    # Calibration and eval share no document (raises otherwise): every calibration draw of this call vs all of eval.
    dense["disjointness"] = prune_real.disjointness(data, [base_n, *(sweep or [])], seeds)
    print(f"[bench] calibration vs eval documents: {dense['disjointness']}", file=sys.stderr, flush=True)
    variants = [v for v in VARIANTS if only is None or v[0] in only]
    runs = [
        (key, over, pat_key, pattern, seed)
        for key, _, over in variants
        for pat_key, pattern in patterns
        if pattern == "unstructured" or over.get("allocation", "uniform") == "uniform"
        for seed in (seeds[:1] if over["method"] == "magnitude" else seeds)
    ]
    if only is None or ORIGINAL in only:
        runs += [
            (ORIGINAL, {"method": "gradprobe", "decision": "original", "base": "magnitude"}, "unstructured_50", "unstructured", s)
            for s in seeds
        ]
        runs += [(MATCHED, {"method": "wanda"}, "unstructured_50", "unstructured", s) for s in seeds]
    base_masks: dict[tuple[str, str, int], dict[str, torch.Tensor]] = {}
    results: list[dict[str, Any]] = []
    # Finished runs, by everything that decides them (the settings after the variant's overrides,
    # so a changed default re-runs exactly the rows it changes); valid for this trained model.
    done_path = work / f"runs-{stamp}.jsonl"

    def finished() -> dict[str, dict[str, Any]]:
        """The cache as it is now: re-read before each row, so a second call on the same work
        directory (another size or seed, side by side) reuses the rows the first one appended."""
        return {r["cache_key"]: r for r in map(json.loads, done_path.read_text().splitlines())} if done_path.exists() else {}

    runs.sort(key=lambda r: [p for p, _ in patterns].index(r[2]))  # every method at 50% first, then 2:4 (stable)
    runs = [(*r, False) for r in runs]
    runs += [
        (key, {**over, "calib_samples": n}, pat_key, pattern, seeds[0], True)
        for n in (sweep or [])
        if n != base_n
        for key, _, over in VARIANTS
        if key in SWEPT
        for pat_key, pattern in patterns
    ]
    not_run = []
    for key, over, pat_key, pattern, seed, swept in runs:
        if cached_only and key == MATCHED and not any(r["key"] == ORIGINAL and r["seed"] == seed for r in results):
            not_run.append({"key": key, "pattern": pat_key, "seed": seed})
            continue
        if key == MATCHED:  # Wanda pruned to exactly what the original-mode GradProbe of this seed reached
            over = {**over, "sparsity": next(r["achieved_sparsity"] for r in results if r["key"] == ORIGINAL and r["seed"] == seed)}
        prune = dataclasses.replace(cfg.prune, pattern=pattern, calib_seed=seed, **over)
        cache_key = json.dumps(dataclasses.asdict(prune), sort_keys=True)
        done = finished()
        if cache_key in done:
            results.append({**done[cache_key], "key": key, "pattern": pat_key, "seed": seed, "sweep": swept})
            print(f"[bench] {key:28s} {pat_key:16s} seed {seed}: reused", file=sys.stderr, flush=True)
            continue
        if cached_only:
            not_run.append({"key": key, "pattern": pat_key, "seed": seed, "calib_samples": prune.calib_samples})
            continue
        engine.module.load_state_dict(dense_state)
        stats, report, _ = prune_and_measure(engine, data, dataclasses.replace(cfg, prune=prune), info, dense, Collectives())
        row = {
            **{k: v for k, v in stats.items() if k != "layers"},
            "key": key,
            "pattern": pat_key,
            "seed": seed,
            "sweep": swept,
            "calib_samples": prune.calib_samples,
            "target_numel": sum(x["numel"] for x in stats["layers"]),
            "settings": dataclasses.asdict(prune),
        }
        if holdout:
            row["holdout_perplexity"] = holdout_perplexity(prune)
        masks = {k: m.clone() for k, m in report.masks.masks.items()}
        if key in ("wanda", "magnitude") and not swept:
            base_masks[(key, pat_key, seed)] = masks
        base = base_masks.get((prune.base, pat_key, seed if prune.base == "wanda" else seeds[0]))
        if prune.method == "gradprobe" and base is not None and key != ORIGINAL and not swept:
            # Share of GradProbe's pruned weights its base would have kept: what the gradient changed.
            row["differs_from_base"] = sum(int((masks[k] & ~base[k]).sum()) for k in masks) / sum(int(m.sum()) for m in masks.values())
        row["cache_key"] = cache_key
        with done_path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        results.append(row)
        print(
            f"[bench] {key:28s} {pat_key:16s} seed {seed} calib {prune.calib_samples}: ppl {row['eval_perplexity_after']:.3f} sparsity "
            f"{row['achieved_sparsity']:.4f} {row['wall_time_s']:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    if only is None or CONTROL in only:
        for (pat_key, pattern), seed in [(pt, s) for pt in patterns for s in seeds]:
            prune = dataclasses.replace(cfg.prune, pattern=pattern, calib_seed=seed)
            cache_key = json.dumps({CONTROL: dataclasses.asdict(prune)}, sort_keys=True)
            done = finished()
            if cache_key in done:
                results.append(done[cache_key])
                continue
            if cached_only:
                not_run.append({"key": CONTROL, "pattern": pat_key, "seed": seed})
                continue
            engine.module.load_state_dict(dense_state)
            row = {**random_pool_control(engine, data, cfg, info, pattern, seed), "key": CONTROL, "pattern": pat_key, "seed": seed}
            row["cache_key"] = cache_key
            with done_path.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")
            results.append(row)
            print(f"[bench] {CONTROL} {pat_key} seed {seed}: ppl {row['eval_perplexity_after']:.3f}", file=sys.stderr, flush=True)
    if not cached_only:
        engine.module.load_state_dict(dense_state)
        dist_utils.teardown()
    return results, {
        "eval_perplexity": dense["eval/perplexity"],
        "eval_loss": dense["eval/loss"],
        "params": params,
        "holdout_perplexity": dense["holdout_perplexity"],
        "disjointness": dense["disjointness"],
        "not_run": not_run,
    }


def finetune_runs(work: Path, cfg_dict: dict[str, Any], hf: str, steps: int, seed: int) -> list[dict[str, Any]]:
    """The masked fine-tune column: `python -m harness.prune` (the command users run) prunes
    the dense model, trains `steps` steps with the masks enforced (AdamW, its own short
    schedule, on the train split) and evaluates on the same eval split."""
    rows = []
    for key in FINETUNED:
        over = next(o for k, _, o in VARIANTS if k == key)
        for pat_key, pattern in PATTERNS:
            out = work / f"ft_{key}_{pat_key.replace(':', '')}"
            path = work / f"{out.name}.yaml"
            prune = {**cfg_dict["prune"], **over, "pattern": pattern, "calib_seed": seed, "finetune_steps": steps}
            path.write_text(
                yaml.safe_dump(
                    {
                        **cfg_dict,
                        "model": {"name": hf},
                        "output_dir": str(out),
                        "checkpoint": {"overwrite": True},
                        "optim": {**cfg_dict["optim"], "lr": 3e-4, "warmup_steps": max(1, steps // 10)},
                        "prune": prune,
                    }
                )
            )
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "harness.prune", "--config", str(path)], cwd=REPO, env=env(), check=True, stdout=subprocess.DEVNULL
            )
            summary = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
            final = [r for r in summary if r["kind"] == "eval"][-1]["eval/perplexity"]
            rows.append(
                {
                    "key": key,
                    "pattern": pat_key,
                    "seed": seed,
                    "finetune_steps": steps,
                    "eval_perplexity_finetuned": final,
                    "wall_s": time.perf_counter() - t0,
                }
            )
            print(f"[bench] fine-tuned {key:12s} {pat_key:16s}: ppl {final:.3f}", file=sys.stderr, flush=True)
    return rows


def prune_world2(work: Path, cfg_dict: dict[str, Any], hf: str, group_size: int) -> dict[str, Any]:
    """GradProbe through the command at world 2 (FSDP2): the per-rank cost."""
    out = work / f"w2_k{group_size}"
    path = work / f"w2_k{group_size}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **cfg_dict,
                "model": {"name": hf},
                "grad_accum": 1,
                "output_dir": str(out),
                "strategy": "fsdp",
                "checkpoint": {"overwrite": True},
                "prune": {**cfg_dict["prune"], "method": "gradprobe", "decision": "veto", "group_size": group_size},
            }
        )
    )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    t0 = time.perf_counter()
    subprocess.run(
        [str(torchrun), "--nproc_per_node=2", f"--master_port={port}", "-m", "harness.prune", "--config", str(path)],
        cwd=REPO,
        env=env(),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    report = json.loads((out / "prune_report.json").read_text())
    report["command_wall_s"] = time.perf_counter() - t0
    return report


def mean_sd(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def summary(results: list[dict[str, Any]], dense: dict[str, Any], finetuned: list[dict[str, Any]]) -> dict[str, Any]:
    """results.json's head: dense perplexity and, per method and pattern, the mean over seeds."""
    out: dict[str, Any] = {"dense_ppl": dense["eval_perplexity"], "ppl": {}, "ppl_sd": {}, "seeds": {}, "achieved_sparsity": {}}
    for key in dict.fromkeys(r["key"] for r in results):
        for pat_key, _ in PATTERNS:
            rows = [r for r in results if r["key"] == key and r["pattern"] == pat_key]
            if not rows:
                continue
            ppl = [r["eval_perplexity_after"] for r in rows]
            out["ppl"].setdefault(key, {})[pat_key] = statistics.mean(ppl)
            out["ppl_sd"].setdefault(key, {})[pat_key] = statistics.stdev(ppl) if len(ppl) > 1 else 0.0
            out["seeds"].setdefault(key, {})[pat_key] = [r["seed"] for r in rows]
            out["achieved_sparsity"].setdefault(key, {})[pat_key] = statistics.mean(r["achieved_sparsity"] for r in rows)
            if all("holdout_perplexity" in r for r in rows):
                out.setdefault("holdout_ppl", {}).setdefault(key, {})[pat_key] = statistics.mean(r["holdout_perplexity"] for r in rows)
    out["ppl_finetuned"] = {}
    for r in finetuned:
        out["ppl_finetuned"].setdefault(r["key"], {})[r["pattern"]] = r["eval_perplexity_finetuned"]
    return out


def tables(
    results: list[dict[str, Any]],
    dense: dict[str, Any],
    trained: dict[str, Any],
    finetuned: list[dict[str, Any]],
    world2: list[dict[str, Any]],
    seeds: list[int],
) -> str:
    head = summary(results, dense, finetuned)
    ft_steps = finetuned[0]["finetune_steps"] if finetuned else 0
    lines = [
        f"Dense model: eval perplexity {dense['eval_perplexity']:.3f} (loss {dense['eval_loss']:.4f}); "
        f"{dense['params']:,} parameters, {results[0]['target_numel']:,} in the pruned decoder Linears.",
        "",
        f"| method | pattern | eval perplexity (mean ± sd, seeds {', '.join(map(str, seeds))}) | vs dense | vs wanda "
        f"| after {ft_steps} masked fine-tune steps (seed {seeds[0]}) | calib holdout perplexity (selection) | achieved sparsity "
        "| wall time (s) | passes fwd / fwd+bwd "
        "| probe memory per rank (MiB) | pruned weights the base keeps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys(r["key"] for r in results):
        for pat_key, _ in PATTERNS:
            rows = [r for r in results if r["key"] == key and r["pattern"] == pat_key]
            if not rows:
                continue
            ppl = statistics.mean(r["eval_perplexity_after"] for r in rows)
            wanda = head["ppl"].get("wanda", {}).get(pat_key)
            ft = head["ppl_finetuned"].get(key, {}).get(pat_key)
            note = " (no calibration data)" if rows[0].get("calib_samples_used") == 0 else ""
            lines.append(
                f"| {LABELS[key]} | {pat_key} | {mean_sd([r['eval_perplexity_after'] for r in rows], '.3f')}{note} "
                f"| {100 * (ppl / dense['eval_perplexity'] - 1):+.1f}% | {'' if wanda is None else f'{100 * (ppl / wanda - 1):+.2f}%'} "
                f"| {'' if ft is None else f'{ft:.3f}'} "
                f"| {mean_sd([r['holdout_perplexity'] for r in rows], '.3f') if all('holdout_perplexity' in r for r in rows) else ''} "
                f"| {mean_sd([r['achieved_sparsity'] for r in rows], '.4f')} "
                f"| {mean_sd([r['wall_time_s'] for r in rows], '.1f')} | {rows[0]['fwd_passes']:g} / {rows[0]['fwd_bwd_passes']:g} "
                f"| {max(r['peak_probe_bytes'] for r in rows) / 2**20:.2f} "
                f"| {mean_sd([100 * r['differs_from_base'] for r in rows], '.1f') + ' %' if 'differs_from_base' in rows[0] else ''} |"
            )
    if world2:
        target = results[0]["target_numel"]
        lines += [
            "",
            "GradProbe cost per rank (the veto, its first default, 50% unstructured, seed 0; "
            "world 2 is FSDP2 through `torchrun -m harness.prune`):",
            "",
            "| world | K | groups | fwd+bwd passes | wall time (s) | probe memory per rank (MiB) | B per pruned parameter per rank |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sorted(world2, key=lambda r: r["group_size"]):
            w = r["world_size"]
            lines.append(
                f"| {w} | {r['group_size']} | {r['groups']} | {r['fwd_bwd_passes']:g} | {r['wall_time_s']:.1f} "
                f"| {r['peak_probe_bytes'] / 2**20:.2f} | {r['peak_probe_bytes'] / (target / w):.2f} |"
            )
    if trained.get("config"):
        lines += [
            "",
            f"Training: {trained['config']['steps']} steps x {16 * 128:,} tokens, "
            f"final train loss {trained['final_train_loss']:.3f}, "
            f"{trained['wall_s']:.0f}s (when not reused from the cache).",
        ]
    return "\n".join(lines)


def sweep_table(results: list[dict[str, Any]]) -> str:
    """The calibration size sweep (seed 0): eval and calib-holdout perplexity, wall time."""
    rows = [r for r in results if r["key"] in SWEPT and r["seed"] == results[0]["seed"]]
    sizes = sorted({r["calib_samples"] for r in rows})
    lines = [
        "| method | pattern | " + " | ".join(f"{n} calib: eval ppl / holdout ppl / s" for n in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    for key in SWEPT:
        for pat_key, _ in PATTERNS:
            cells = []
            for n in sizes:
                r = next((r for r in rows if r["key"] == key and r["pattern"] == pat_key and r["calib_samples"] == n), None)
                cells.append(
                    ""
                    if r is None
                    else f"{r['eval_perplexity_after']:.3f} / {r.get('holdout_perplexity', float('nan')):.3f} / {r['wall_time_s']:.0f}"
                )
            lines.append(f"| {LABELS[key]} | {pat_key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_ft(spec: str) -> tuple[str, str, int]:
    """METHOD:PATTERN:STEPS (the pattern may hold a colon: wanda:2:4:5)."""
    method, rest = spec.split(":", 1)
    pattern, steps = rest.rsplit(":", 1)
    return method, pattern, int(steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/prune_bench", help="working directory (trained model cache, results)")
    parser.add_argument("--train-steps", type=int, default=4000)
    parser.add_argument("--train-only", action="store_true", help="train (or reuse) the dense model and stop")
    parser.add_argument("--calib-samples", type=int, default=None, help="default: 64 (bench-llama), 32 (smollm2-135m)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", default=None, help="run only these result keys (a study; results.json is not written)")
    parser.add_argument("--finetune-steps", type=int, default=None, help="masked fine-tune column (0: skip; default 200, smollm2 0)")
    parser.add_argument("--world2", action="store_true", help="also the world-2 cost rows (torchrun, FSDP2)")
    parser.add_argument("--results", default=None, help="default: benchmarks/results/pruning/results.json (smollm2-135m: ..._smollm2.json)")
    parser.add_argument(
        "--model",
        choices=["bench-llama", prune_real.MODEL],
        default="bench-llama",
        help="bench-llama: trained here (fast); smollm2-135m: the real pretrained model, pruned as loaded",
    )
    parser.add_argument("--seq-len", type=int, default=256, help="smollm2-135m: sequence length of calibration and eval")
    parser.add_argument("--eval-batches", type=int, default=8, help="smollm2-135m: eval batches of 4 sequences")
    parser.add_argument(
        "--calib-fraction", type=float, default=0.10, help="smollm2-135m: data.calib_fraction (0.2 makes room for 512 samples)"
    )
    parser.add_argument("--calib-sweep", type=int, nargs="*", default=[], help="calibration sizes for wanda/sparsegpt/gradprobe (seed 0)")
    parser.add_argument("--no-holdout", action="store_true", help="skip each run's calib-holdout perplexity")
    parser.add_argument("--cached-only", action="store_true", help="report the runs earlier calls finished; run nothing new")
    parser.add_argument("--patterns", nargs="+", choices=[k for k, _ in PATTERNS], default=None, help="a subset of the patterns")
    parser.add_argument("--extra", nargs="+", default=[], help="smollm2-135m: more result keys (kept in the results file)")
    parser.add_argument("--original", action="store_true", help="smollm2-135m: also GradProbe's original mode (2 passes per matrix)")
    parser.add_argument(
        "--finetune-world2",
        nargs="*",
        default=[],
        metavar="METHOD:PATTERN:STEPS",
        help="smollm2-135m: prune -> masked fine-tune -> export under FSDP2 at world 2, export checked against the masks",
    )
    parser.add_argument("--finetune-lr", type=float, default=1e-4, help="--finetune-world2's learning rate")
    parser.add_argument("--finetune-micro-batch", type=int, default=4, help="--finetune-world2's micro-batch per rank")
    parser.add_argument("--finetune-eval-every", type=int, default=0, help="--finetune-world2's eval cadence (the recovery curve)")
    parser.add_argument(
        "--finetune-only", action="store_true", help="only --finetune-world2, its rows merged into the results file (if any)"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    real = args.model == prune_real.MODEL
    work = Path(args.work if args.work != "runs/prune_bench" or not real else "runs/prune_bench_smollm2").resolve()
    results_path = args.results or str(REPO / "benchmarks" / "results" / "pruning" / ("results_smollm2.json" if real else "results.json"))
    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    if real and args.finetune_only:  # the world-2 workflow alone, merged into the results of an earlier call
        cfg = prune_real.real_config(work, args.calib_samples or 32, args.seq_len, args.eval_batches, args.calib_fraction)
        rows = [
            prune_real.finetune_world2(work, cfg, *parse_ft(spec), args.finetune_lr, args.finetune_micro_batch, args.finetune_eval_every)
            for spec in args.finetune_world2
        ]
        path = Path(results_path) if Path(results_path).exists() else work / "finetune_world2.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        record["finetune_world2"] = [*record.get("finetune_world2", []), *rows]
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(json.dumps(rows, indent=1))
        return 0
    if real:  # pretrained: nothing to train; the four methods (and the original mode on request)
        cfg = prune_real.real_config(work, args.calib_samples or 32, args.seq_len, args.eval_batches, args.calib_fraction)
        trained = {"hf": cfg["model"]["name"], "model": prune_real.MODEL}
        only = args.only or ["magnitude", "wanda", "sparsegpt", "gradprobe", *args.extra, *([ORIGINAL, MATCHED] if args.original else [])]
        stamp: str | None = prune_real.model_stamp(trained["hf"], cfg)
    else:
        cfg = base_config(work, args.train_steps, args.calib_samples or 64)
        trained = train_dense(work, cfg)
        print(f"[bench] dense model: eval perplexity {trained['eval_perplexity']:.3f}", file=sys.stderr, flush=True)
        if args.train_only:
            return 0
        only, stamp = args.only, None
    patterns = [p for p in PATTERNS if args.patterns is None or p[0] in args.patterns]
    results, dense = prune_in_process(
        work, cfg, trained["hf"], args.seeds, only, stamp, args.calib_sweep, not args.no_holdout, args.cached_only, patterns, real
    )
    swept = [r for r in results if r.get("sweep")]
    results = [r for r in results if not r.get("sweep")]
    swept += [r for r in results if r["key"] in SWEPT and r["seed"] == args.seeds[0]]
    ft_steps = args.finetune_steps if args.finetune_steps is not None else (0 if real else 200)
    finetuned = [] if args.only or not ft_steps else finetune_runs(work, cfg, trained["hf"], ft_steps, args.seeds[0])
    world2 = [prune_world2(work, cfg, trained["hf"], k) for k in (1, 0)] if args.world2 else []
    previous = json.loads(Path(results_path).read_text()) if Path(results_path).exists() else {}
    ft_world2 = [] if args.finetune_world2 else previous.get("finetune_world2", [])  # rows of an earlier --finetune-only call are kept
    for spec in args.finetune_world2:
        ft = parse_ft(spec)
        ft_world2.append(prune_real.finetune_world2(work, cfg, *ft, args.finetune_lr, args.finetune_micro_batch, args.finetune_eval_every))
        print(f"[bench] prune -> fine-tune, FSDP2 world 2: {json.dumps(ft_world2[-1])}", file=sys.stderr, flush=True)
    table = tables(results, dense, trained, finetuned, world2, args.seeds)
    if args.calib_sweep:
        table += "\n\nCalibration size sweep (seed " + str(args.seeds[0]) + "):\n\n" + sweep_table(swept)
    total = time.perf_counter() - t0
    record = {
        **summary(results, dense, finetuned),
        "dense": dense,
        "trained": trained,
        "runs": results,
        "calib_sweep": swept if args.calib_sweep else [],
        "finetuned": finetuned,
        "finetune_world2": ft_world2,
        "world2": world2,
        "total_wall_s": total,
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        # what the retired companion scripts merged in (veto sweep, probe memory: benchmarks/README.md): kept
        **{k: previous[k] for k in ("veto_sweep", "probe_memory") if k in previous},
    }
    (work / "results.json").write_text(json.dumps(record, indent=1, default=str))
    (work / "table.md").write_text(table + "\n")
    if not args.only:
        Path(results_path).parent.mkdir(parents=True, exist_ok=True)
        Path(results_path).write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(table)
    print(f"\n[bench] total {total:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
