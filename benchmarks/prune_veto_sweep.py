"""GradProbe's veto threshold chosen on the calibration holdout, from one probe (SmolLM2-135M).

    OMP_NUM_THREADS=2 nice -n 19 python benchmarks/prune_veto_sweep.py --thresholds 0 0.1 0.5 2 inf

GradProbe's veto decision (`veto`, its first default) prunes Wanda's order inside a pool 25% wider than the
target, except that pool members whose gradient grew when the pool was shrunk (G1/G0 > 1 +
`threshold`) go behind the others. G0 and G1 do not depend on the threshold, so one probe
(its two forward+backward passes) serves every threshold: the probe runs once through
`run_pruning` (the veto at its default settings, nothing applied), its per-matrix decision inputs (pool,
G0, G1, base scores) are recorded as `veto_keys` receives them, and each threshold's masks are
the same selection on `veto_keys(..., threshold)`. Threshold 0 reproduces the default run;
threshold inf vetoes nothing and must give Wanda's masks exactly (checked).

Each threshold is scored on the calib holdout (the last 32 blocks of the seed's permutation of
the calib split, never calibrated on; the same blocks `prune_bench.py --model smollm2-135m` uses);
eval perplexity only for the default and the holdout's choice. Nothing is chosen on eval.
Writes `<work>/veto_sweep_<pattern>.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import prune_bench  # noqa: E402
import prune_real  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

import harness.pruning.gradprobe as gradprobe  # noqa: E402
from harness import distributed as dist_utils  # noqa: E402
from harness.config import load_config, load_strategy  # noqa: E402
from harness.distributed import Collectives  # noqa: E402
from harness.pruning import MaskSet, build_views, restore_views, run_pruning, snapshot_views  # noqa: E402
from harness.pruning.methods import COMPOSITE_BITS, gradient_ratio, make_rule, select, veto_keys  # noqa: E402
from harness.runner import HOLDOUT_SPLIT, build_run, calibration_batches, calibration_split, evaluate, preflight  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/prune_bench_smollm2")
    parser.add_argument("--pattern", default="unstructured", choices=["unstructured", "2:4"])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.0, 0.1, 0.5, 2.0, math.inf])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--model-dir", default=None, help="another HF model directory (a quick check of this script)")
    args = parser.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cfg_dict = prune_real.real_config(work, args.calib_samples, 256, args.eval_batches)
    if args.model_dir:
        cfg_dict["model"] = {"name": args.model_dir}
    path = work / "veto_sweep.yaml"
    # the veto, named (the default decision is reconstruct now); prune_bench.py's Wanda masks are found by the same settings
    prune = {**cfg_dict["prune"], "method": "gradprobe", "decision": "veto", "pattern": args.pattern, "calib_seed": args.seed}
    path.write_text(yaml.safe_dump({**cfg_dict, "output_dir": str(work / "veto_sweep"), "checkpoint": {"overwrite": True}, "prune": prune}))
    cfg = load_config(str(path), ["strategy=ddp"])
    info = dist_utils.init_distributed(cfg.device)
    loop, _ = build_run(cfg, preflight(cfg, load_strategy("ddp")), info)
    engine, data, comm = loop.engine, loop.data, Collectives()
    dense_state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    samples, holdout = calibration_split(data, cfg)
    holdout = holdout[-cfg.eval_batches * cfg.micro_batch_size :]  # the tail: the same blocks at any calibration size
    val = dataclasses.replace(data, blocks={**data.blocks, HOLDOUT_SPLIT: holdout})
    batches = calibration_batches(samples, cfg, info, comm)

    recorded: list[tuple[torch.Tensor, ...]] = []
    original_veto_keys = gradprobe.veto_keys

    def recording(pool: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor, base: torch.Tensor, threshold: float, forced: Any) -> Any:
        recorded.append((pool, g0, g1, base))
        return original_veto_keys(pool, g0, g1, base, threshold, forced)

    gradprobe.veto_keys = recording  # the probe's decision inputs, per matrix in build_views order
    t0 = time.perf_counter()
    views = build_views(engine.model, cfg.prune.targets, comm)
    dense = snapshot_views(views)  # the decisions only: the weights are put back
    with engine.backward_without_step():
        report = run_pruning(
            engine.model,
            batches,
            cfg.prune,
            lambda _, b: engine.forward_loss(b),
            grad_accum=None if engine.owns_grad_accumulation else cfg.grad_accum,
            comm=comm,
        )
    probe_s = time.perf_counter() - t0
    restore_views(views, dense, comm)
    del dense
    gradprobe.veto_keys = original_veto_keys
    if len(recorded) != len(views):
        raise RuntimeError(f"recorded {len(recorded)} decisions for {len(views)} matrices (the decision must be veto)")
    rule = make_rule(dataclasses.replace(cfg.prune, method="gradprobe", scope="per_matrix"))
    layouts = [v.layout for v in views]

    def masks_at(threshold: float) -> dict[str, torch.Tensor]:
        keys = [veto_keys(pool, g0, g1, base, threshold, None) for pool, g0, g1, base in recorded]
        return {v.name: m for v, m in zip(views, select(rule, layouts, keys, comm, COMPOSITE_BITS + 1))}

    default = masks_at(cfg.prune.threshold)
    if any(not torch.equal(default[k], report.masks.masks[k]) for k in default):
        raise RuntimeError("the recorded decision inputs do not reproduce the run's own masks")
    wanda = masks_at(math.inf)  # nothing vetoed: Wanda's order inside the pool, i.e. Wanda's choice
    pruned = sum(int(m.sum()) for m in wanda.values())
    # prune_bench's own Wanda run of the same seed and pattern (its saved masks), if it ran: must be the same choice
    wanda_key = json.dumps(dataclasses.asdict(dataclasses.replace(cfg.prune, method="wanda")), sort_keys=True)
    wanda_file = work / "masks" / f"{hashlib.sha256(wanda_key.encode()).hexdigest()[:16]}.pt"
    inf_equals_wanda = None
    if wanda_file.exists():
        ran = prune_bench.load_masks(wanda_file)
        inf_equals_wanda = all(torch.equal(ran[k], wanda[k]) for k in wanda)
        print(f"[veto] threshold inf vs the Wanda run's masks: equal={inf_equals_wanda}", file=sys.stderr, flush=True)
    rows = []
    for t in args.thresholds:
        masks = masks_at(t)
        in_pool = sum(int(p.sum()) for p, *_ in recorded)
        vetoed = sum(int((p & (gradient_ratio(g0, g1) > 1.0 + t)).sum()) for p, g0, g1, _ in recorded)
        swapped = sum(int((masks[k] & ~wanda[k]).sum()) for k in masks)
        engine.module.load_state_dict(dense_state)
        MaskSet(masks).apply(views, comm)
        row: dict[str, Any] = {
            "threshold": t,
            "vetoed_share_of_pool": vetoed / in_pool,
            "swapped_vs_wanda": swapped,
            "swapped_share_of_pruned": swapped / pruned,
            "holdout_perplexity": evaluate(engine, val, cfg, info, split=HOLDOUT_SPLIT)["eval/perplexity"],
        }
        rows.append(row)
        print(f"[veto] {json.dumps(row)}", file=sys.stderr, flush=True)
    best = min(rows, key=lambda r: (r["holdout_perplexity"], -r["threshold"]))
    for row in rows:
        if row["threshold"] in (cfg.prune.threshold, best["threshold"]) and row["swapped_vs_wanda"] > 0:
            engine.module.load_state_dict(dense_state)
            MaskSet(masks_at(row["threshold"])).apply(views, comm)
            row["eval_perplexity"] = evaluate(engine, data, cfg, info)["eval/perplexity"]
            print(f"[veto] threshold {row['threshold']}: eval {row['eval_perplexity']:.3f}", file=sys.stderr, flush=True)
    engine.module.load_state_dict(dense_state)
    out = {
        "pattern": args.pattern,
        "seed": args.seed,
        "calib_samples": args.calib_samples,
        "probe_wall_s": probe_s,
        "fwd_bwd_passes": report.fwd_bwd_passes,
        "pool": cfg.prune.pool,
        "reduction": cfg.prune.reduction,
        "holdout_blocks": int(holdout.shape[0]),
        "chosen_on_holdout": best["threshold"],
        "threshold_inf_equals_wanda_run": inf_equals_wanda,
        "rows": rows,
        "command": " ".join(["prune_veto_sweep.py", *(argv or sys.argv[1:])]),
    }
    (work / f"veto_sweep_{args.pattern.replace(':', '')}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    dist_utils.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
