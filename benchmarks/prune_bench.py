"""Pruning benchmark: magnitude, Wanda, SparseGPT and GradProbe on a trained model, honestly.

    OMP_NUM_THREADS=1 python benchmarks/prune_bench.py --work runs/prune_bench

1. Trains `small-llama` (4 layers, hidden 256, 3.95M parameters with the 2048-token BPE
   vocabulary; 2.88M of them in the pruned decoder Linears) on the embedded corpus with
   `python -m harness.train` and exports it to an HF directory (cached in `--work`: a
   second run with the same settings reuses it).
2. In one process (world 1, the trainer's own engine built by `harness.train.build_run`),
   restores the dense weights before every run and calls the pruning stage
   (`harness.prune.run_prune_stage`) for each method x pattern x calibration seed.
   Calibration samples come from the `calib` split; perplexity is measured on the `eval`
   split, which calibration never touches. GradProbe runs with its defaults (reduction
   0.1, pool 0.25, exact target): nothing was tuned, on eval or anywhere else.
3. The cost rows: GradProbe K=1 vs K=all at world 1 (in process) and at world 2
   (`torchrun --nproc_per_node 2 -m harness.prune`, FSDP2), passes over the calibration
   set and probe memory per rank against 4 B x parameters / world + one layer group.

Writes `<work>/results.json` and `<work>/table.md` (the tables for notes/pruning.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

METHODS = [  # (label, prune overrides); magnitude does not read calibration data: one seed
    ("magnitude", {"method": "magnitude"}),
    ("wanda", {"method": "wanda"}),
    ("sparsegpt", {"method": "sparsegpt"}),
    ("gradprobe (wanda base)", {"method": "gradprobe", "base": "wanda"}),
    ("gradprobe (magnitude base)", {"method": "gradprobe", "base": "magnitude"}),
]
PATTERNS = [("50% unstructured", "unstructured"), ("2:4", "2:4")]
ORIGINAL = "gradprobe original (wanda base, threshold 0)"  # the reference's veto: undershoots the target
MATCHED = "wanda at the same achieved sparsity"
CONTROL = "control: random choice in GradProbe's Wanda pool"


def random_pool_control(engine: Any, data: Any, cfg: Any, info: Any, pattern: str, seed: int) -> dict[str, Any]:
    """What exact-target GradProbe would score if its gradient ranking were noise: the same
    candidate pool (Wanda at sparsity x (1 + pool); 2:4: the 3 lowest of each 4), the same
    pruned count per row / group, chosen uniformly at random (seeded). World 1 only."""
    import torch

    from harness.pruning import Comm, build_views, run_pruning
    from harness.runner import evaluate
    from harness.runner.prune_stage import calibration_batches, calibration_split

    p = cfg.prune
    pool_cfg = dataclasses.replace(p, method="wanda", calib_seed=seed, pattern="1:4" if pattern == "2:4" else pattern,
                                   sparsity=0.75 if pattern == "2:4" else p.sparsity * (1 + p.pool))
    samples, _ = calibration_split(data, dataclasses.replace(cfg, prune=pool_cfg))
    batches = calibration_batches(samples, cfg, info, Comm())
    report = run_pruning(engine.model, batches, pool_cfg, lambda _, b: engine.forward_loss(b), grad_accum=cfg.grad_accum, apply=False)
    g = torch.Generator().manual_seed(1000 + seed)
    pruned = total = 0
    with torch.no_grad():
        for v in build_views(engine.model, p.targets, Comm()):
            pool = report.masks[v.name].reshape(v.rows, v.cols)
            width, k = (4, 2) if pattern == "2:4" else (v.cols, int(v.cols * p.sparsity))  # Wanda's per-row count
            noise = torch.rand(v.rows, v.cols, generator=g).masked_fill(~pool, float("inf")).reshape(v.rows, -1, width)
            chosen = torch.zeros_like(noise, dtype=torch.bool).scatter_(-1, noise.topk(k, dim=-1, largest=False).indices, True)
            v.param.data[chosen.reshape(v.rows, v.cols)] = 0
            pruned, total = pruned + int(chosen.sum()), total + v.numel
    return {"eval_perplexity_after": evaluate(engine, data, cfg, info)["eval/perplexity"], "achieved_sparsity": pruned / total,
            "fwd_passes": report.fwd_passes, "fwd_bwd_passes": 0.0, "group_size": report.group_size, "groups": report.groups,
            "peak_probe_bytes": report.peak_probe_bytes, "wall_time_s": report.wall_time_s, "target_numel": total}


def base_config(work: Path, steps: int, calib: int) -> dict[str, Any]:
    """One config for training and pruning: the eval set is the same 400 blocks in both."""
    return {
        "model": {"name": "small-llama", "seed": 0},
        "data": {"seq_len": 128, "max_tokens": None, "cache_dir": str(work / "cache")},
        "micro_batch_size": 8, "grad_accum": 2, "steps": steps, "eval_batches": 50,
        "optim": {"lr": 3e-3, "warmup_steps": 30, "schedule": "cosine", "min_lr_ratio": 0.1},
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
    path.write_text(yaml.safe_dump({**cfg, "checkpoint": {"export_hf": True, "overwrite": True}}))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "harness.train", "--config", str(path)], cwd=REPO, env=env(), check=True,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (work / "dense" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if r["kind"] == "eval"]
    out = {"config": key, "wall_s": time.perf_counter() - t0, "eval_perplexity": evals[-1]["eval/perplexity"],
           "final_train_loss": [r for r in rows if "train/loss" in r][-1]["train/loss"], "hf": str(hf)}
    stamp.write_text(json.dumps(out, indent=1))
    return out


def prune_in_process(work: Path, cfg_dict: dict[str, Any], hf: str, seeds: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every method x pattern x seed on one engine, dense weights restored before each run."""
    import torch

    from harness import distributed as dist_utils
    from harness.config import load_config, load_strategy
    from harness.runner import build_run, evaluate, run_prune_stage

    path = work / "prune.yaml"
    path.write_text(yaml.safe_dump({**cfg_dict, "model": {"name": hf}, "steps": 1, "output_dir": str(work / "prune_w1"),
                                    "checkpoint": {"overwrite": True}}))
    cfg = load_config(str(path), ["strategy=ddp"])
    info = dist_utils.init_distributed(cfg.device)
    loop, _ = build_run(cfg, load_strategy("ddp"), info)
    engine, data = loop.engine, loop.data
    dense_state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    dense = evaluate(engine, data, cfg, info)
    results = []
    runs = [(label, over, pat_label, pattern, seed) for label, over in METHODS for pat_label, pattern in PATTERNS
            for seed in (seeds[:1] if over["method"] == "magnitude" else seeds)]
    runs += [("gradprobe K=1 (wanda base)", {"method": "gradprobe", "base": "wanda", "group_size": 1}, "50% unstructured", "unstructured",
              seeds[0])]
    runs += [(ORIGINAL, {"method": "gradprobe", "base": "wanda", "exact_target": False}, "50% unstructured", "unstructured", s)
             for s in seeds]
    runs += [(MATCHED, {"method": "wanda"}, "50% unstructured", "unstructured", s) for s in seeds]
    base_masks: dict[tuple[str, str, int], dict[str, torch.Tensor]] = {}
    for label, over, pat_label, pattern, seed in runs:
        engine.module.load_state_dict(dense_state)
        if label == MATCHED:  # Wanda pruned to exactly what the original-mode GradProbe of this seed reached
            over = {**over, "sparsity": next(r["achieved_sparsity"] for r in results if r["label"] == ORIGINAL and r["seed"] == seed)}
        prune = dataclasses.replace(cfg.prune, pattern=pattern, calib_seed=seed, **over)
        stats = run_prune_stage(engine, data, dataclasses.replace(cfg, prune=prune), info, enforce=False, save_masks=False, before=dense)
        row = {**{k: v for k, v in stats.items() if k != "layers"}, "label": label, "pattern": pat_label, "seed": seed}
        row["target_numel"] = sum(x["numel"] for x in stats["layers"])
        masks = {k: m.clone() for k, m in stats.masks.masks.items()}
        if over["method"] in ("wanda", "magnitude") and label != MATCHED:
            base_masks[(over["method"], pat_label, seed)] = masks
        base = base_masks.get((over.get("base", ""), pat_label, seed if over.get("base") == "wanda" else seeds[0]))
        if over["method"] == "gradprobe" and base is not None and over.get("exact_target", True):
            # Share of GradProbe's pruned weights its base would have kept: what the gradient veto changed.
            row["differs_from_base"] = sum(int((masks[k] & ~base[k]).sum()) for k in masks) / sum(int(m.sum()) for m in masks.values())
        results.append(row)
        print(f"[bench] {label:28s} {pat_label:17s} seed {seed}: ppl {row['eval_perplexity_after']:.3f} sparsity "
              f"{row['achieved_sparsity']:.4f} {row['wall_time_s']:.1f}s", file=sys.stderr, flush=True)
    for (pat_label, pattern), seed in [(pt, s) for pt in PATTERNS for s in seeds]:
        engine.module.load_state_dict(dense_state)
        row = {**random_pool_control(engine, data, cfg, info, pattern, seed), "label": CONTROL, "pattern": pat_label, "seed": seed}
        results.append(row)
        print(f"[bench] {CONTROL} {pat_label} seed {seed}: ppl {row['eval_perplexity_after']:.3f}", file=sys.stderr, flush=True)
    engine.module.load_state_dict(dense_state)
    params = sum(p.numel() for p in engine.module.parameters())
    dist_utils.teardown()
    return results, {"eval_perplexity": dense["eval/perplexity"], "eval_loss": dense["eval/loss"], "params": params}


def prune_world2(work: Path, cfg_dict: dict[str, Any], hf: str, group_size: int) -> dict[str, Any]:
    """GradProbe through the command at world 2 (FSDP2): the per-rank cost."""
    out = work / f"w2_k{group_size}"
    path = work / f"w2_k{group_size}.yaml"
    path.write_text(yaml.safe_dump({**cfg_dict, "model": {"name": hf}, "grad_accum": 1, "output_dir": str(out), "strategy": "fsdp",
                                    "checkpoint": {"overwrite": True},
                                    "prune": {**cfg_dict["prune"], "method": "gradprobe", "base": "wanda", "group_size": group_size}}))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    t0 = time.perf_counter()
    subprocess.run([str(torchrun), "--nproc_per_node=2", f"--master_port={port}", "-m", "harness.prune", "--config", str(path)],
                   cwd=REPO, env=env(), check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "prune_report.json").read_text())
    report["command_wall_s"] = time.perf_counter() - t0
    return report


def mean_sd(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def tables(results: list[dict[str, Any]], dense: dict[str, Any], trained: dict[str, Any], world2: list[dict[str, Any]],
           seeds: list[int]) -> str:
    lines = [
        f"Dense model: eval perplexity {dense['eval_perplexity']:.3f} (loss {dense['eval_loss']:.4f}); "
        f"{dense['params']:,} parameters, {results[0]['target_numel']:,} in the pruned decoder Linears.",
        "",
        f"| method | pattern | eval perplexity (mean ± sd, seeds {', '.join(map(str, seeds))}) | achieved sparsity | wall time (s) "
        "| passes fwd / fwd+bwd | K (groups) | probe memory per rank (MiB) | pruned weights the base keeps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = [(label, pat) for label, _ in METHODS for pat, _ in PATTERNS] + [(CONTROL, pat) for pat, _ in PATTERNS] \
        + [(ORIGINAL, PATTERNS[0][0]), (MATCHED, PATTERNS[0][0])]
    for label, pat in order:
        rows = [r for r in results if r["label"] == label and r["pattern"] == pat]
        if not rows:
            continue
        seeds_note = "" if len(rows) > 1 else " (no calibration data: seed-independent)"
        lines.append(
            f"| {label} | {pat} | {mean_sd([r['eval_perplexity_after'] for r in rows], '.3f')}{seeds_note} "
            f"| {mean_sd([r['achieved_sparsity'] for r in rows], '.4f')} | {mean_sd([r['wall_time_s'] for r in rows], '.1f')} "
            f"| {rows[0]['fwd_passes']:g} / {rows[0]['fwd_bwd_passes']:g} | {rows[0]['group_size']} ({rows[0]['groups']}) "
            f"| {max(r['peak_probe_bytes'] for r in rows) / 2**20:.2f} "
            f"| {mean_sd([100 * r['differs_from_base'] for r in rows], '.1f') + ' %' if 'differs_from_base' in rows[0] else ''} |"
        )
    target = results[0]["target_numel"]
    lines += [
        "",
        "GradProbe cost (Wanda base, 50% unstructured, calibration seed 0; P = pruned parameters; the issue's target is "
        "4 B x P / world + one layer group; world 2 is FSDP2 through `torchrun -m harness.prune`):",
        "",
        "| world | K | groups | fwd+bwd passes | wall time (s) | probe memory per rank (MiB) | 4 B x P / world (MiB) | "
        "B per pruned parameter per rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cost = [r for r in results if r["label"] in ("gradprobe (wanda base)", "gradprobe K=1 (wanda base)")
            and r["pattern"] == "50% unstructured"
            and r["seed"] == seeds[0]]
    for r in sorted(cost, key=lambda r: r["group_size"]) + sorted(world2, key=lambda r: r["group_size"]):
        w = r["world_size"]
        lines.append(f"| {w} | {r['group_size']} | {r['groups']} | {r['fwd_bwd_passes']:g} | {r['wall_time_s']:.1f} "
                     f"| {r['peak_probe_bytes'] / 2**20:.2f} | {4 * target / w / 2**20:.2f} | {r['peak_probe_bytes'] / (target / w):.2f} |")
    lines += ["", f"Training: {trained['config']['steps']} steps x {16 * 128:,} tokens, "
              f"final train loss {trained['final_train_loss']:.3f}, "
              f"{trained['wall_s']:.0f}s (when not reused from the cache)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/prune_bench", help="working directory (trained model cache, results)")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--no-world2", action="store_true", help="skip the world-2 cost rows (torchrun)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.work).resolve()
    t0 = time.perf_counter()
    cfg = base_config(work, args.train_steps, args.calib_samples)
    trained = train_dense(work, cfg)
    print(f"[bench] dense model: eval perplexity {trained['eval_perplexity']:.3f}", file=sys.stderr, flush=True)
    results, dense = prune_in_process(work, cfg, trained["hf"], args.seeds)
    world2 = [] if args.no_world2 else [prune_world2(work, cfg, trained["hf"], k) for k in (1, 0)]
    table = tables(results, dense, trained, world2, args.seeds)
    total = time.perf_counter() - t0
    (work / "results.json").write_text(json.dumps({"dense": dense, "trained": trained, "runs": results, "world2": world2,
                                                   "total_wall_s": total}, indent=1, default=str))
    (work / "table.md").write_text(table + "\n")
    print(table)
    print(f"\n[bench] total {total:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
