"""Block-streamed pruning with reconstruction (`harness.pruning.reconstruct`) against Wanda and
SparseGPT on SmolLM2-135M, chosen on the calibration holdout (never eval).

    OMP_NUM_THREADS=2 python benchmarks/prune_recon.py --pattern 2:4 --variants sparsegpt recon:steps=0 recon:steps=8

Same setup as `prune_bench.py --model smollm2-135m` (world 1, fp32, 32 calibration sequences of
256, holdout = the last 32 blocks of the seed's calib permutation, eval = the first 32 eval
blocks), all variants in one process so wall times compare within a call. A variant is a method
(`magnitude`, `wanda`, `sparsegpt`, `gradprobe`: its defaults, the veto) or `recon:key=value,...`
(ReconSettings fields; `eval=1`: eval perplexity for this variant). Each row is appended to
`--out` (JSONL) with holdout perplexity, wall and process CPU seconds and, with `--eval`, eval perplexity.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import prune_real  # noqa: E402
import yaml  # noqa: E402


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    if ":" not in spec:
        return spec, {}
    name, rest = spec.split(":", 1)
    out: dict[str, Any] = {}
    for kv in filter(None, rest.split(",")):
        k, v = kv.split("=")
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return name, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/prune_bench_smollm2")
    ap.add_argument("--pattern", default="2:4", help="2:4 or a sparsity such as 0.6 (unstructured)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--eval", action="store_true", help="also the eval split (only for the chosen configuration)")
    ap.add_argument("--out", default="benchmarks/results/pruning/recon_smollm2.jsonl")
    args = ap.parse_args()

    import torch

    from harness import distributed as dist_utils
    from harness.config import load_config, load_strategy, resolve_prune
    from harness.distributed import Collectives
    from harness.pruning import build_views, run_pruning
    from harness.pruning.calibration import Ledger, Runner
    from harness.pruning.methods import make_rule
    from harness.pruning.reconstruct import ReconSettings, run_reconstruct
    from harness.runner import HOLDOUT_SPLIT, build_run, calibration_batches, calibration_split, evaluate, preflight

    work = (REPO / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cfg_dict = prune_real.real_config(work, 32, 256, 8)
    path = work / "recon.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **cfg_dict,
                "output_dir": str(work / "recon_w1"),
                "checkpoint": {"overwrite": True},
                "prune": {**cfg_dict["prune"], "method": "wanda"},
            }
        )
    )
    cfg = load_config(str(path), ["strategy=ddp"])
    nm = ":" in args.pattern
    pattern, sparsity = (args.pattern, 0.5) if nm else ("unstructured", float(args.pattern))
    base_prune = dataclasses.replace(cfg.prune, pattern=pattern, sparsity=sparsity, calib_seed=args.seed)
    cfg = dataclasses.replace(cfg, prune=base_prune)
    info = dist_utils.init_distributed(cfg.device)
    loop, _ = build_run(cfg, preflight(cfg, load_strategy("ddp")), info)
    engine, data = loop.engine, loop.data
    dense_state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    comm = Collectives()
    samples, holdout = calibration_split(data, cfg)
    holdout = holdout[-cfg.eval_batches * cfg.micro_batch_size :]
    val = dataclasses.replace(data, blocks={**data.blocks, HOLDOUT_SPLIT: holdout})
    batches = calibration_batches(samples, cfg, info, comm)
    loss_fn = lambda _, b: engine.forward_loss(b)
    out_path = REPO / args.out
    for spec in args.variants:
        name, over = parse_variant(spec)
        want_eval = args.eval or bool(over.pop("eval", 0))  # `eval=1` in a variant: eval for that one only
        engine.module.load_state_dict(dense_state)
        torch.manual_seed(0)
        t0, c0 = time.perf_counter(), time.process_time()
        if name in ("wanda", "sparsegpt", "magnitude", "gradprobe"):
            method_config = dataclasses.replace(base_prune, method=name)
            if name == "gradprobe":  # the veto, GradProbe's first default, whatever the schema's default is now
                method_config = dataclasses.replace(method_config, decision="veto")
            rep = run_pruning(engine.model, batches, method_config, loss_fn, grad_accum=cfg.grad_accum, comm=comm)
            extra = {"fwd_passes": rep.fwd_passes, "peak_probe_bytes": rep.peak_probe_bytes, "achieved_sparsity": rep.achieved_sparsity}
        elif name == "recon":
            settings = ReconSettings(**over)
            views = build_views(engine.model, base_prune.targets, comm)
            runner = Runner(engine.model, loss_fn, cfg.grad_accum, comm)
            rule = make_rule(resolve_prune(dataclasses.replace(base_prune, method="sparsegpt", scope="per_matrix"))[0])
            ledger = Ledger()
            with runner.eval_mode():
                masks = run_reconstruct(runner, batches, views, rule, comm, ledger, settings)
            pruned = sum(int(m.sum()) for m in masks.values())
            zeros = sum(int((v.weight() == 0).sum()) for v in views)
            extra = {
                "settings": dataclasses.asdict(settings),
                "fwd_passes": runner.fwd_batches / len(batches),
                "fwd_bwd_passes": runner.fwd_bwd_batches / len(batches),
                "peak_probe_bytes": ledger.peak,
                "achieved_sparsity": pruned / sum(v.numel for v in views),
                "zeros_minus_masked": zeros - pruned,
            }
        else:
            raise SystemExit(f"unknown variant {spec}")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        row = {"variant": spec, "pattern": args.pattern, "seed": args.seed, "wall_s": wall, "cpu_s": cpu, **extra}
        row["holdout_ppl"] = evaluate(engine, val, cfg, info, split=HOLDOUT_SPLIT)["eval/perplexity"]
        if want_eval:
            row["eval_ppl"] = evaluate(engine, data, cfg, info)["eval/perplexity"]
        row["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        print(json.dumps(row), flush=True)
        with out_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
    dist_utils.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
