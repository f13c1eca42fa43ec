"""Where is the signal? Each pruning score against the true loss increase of removing one weight.

    OMP_NUM_THREADS=1 python benchmarks/prune_signal.py --work runs/prune_bench

On the pruning benchmark's trained model (`benchmarks/prune_bench.py` trains and caches it),
for a few matrices: the candidate pool of exact-target GradProbe (Wanda per row at 50% x
1.25), a seeded sample of pool weights, and for each the true increase of the calibration
loss when that one weight is zeroed (the same 64 calibration sequences the scores see,
fp64 sums), and on as many held-out calib blocks the scores never see. Reported: Spearman
rank correlation between that increase and each score
(higher = the score orders weights as their removal actually costs):
|W|, Wanda |W|·‖X‖, Taylor |W|·‖G‖ (per-step gradients), G1/G0 (GradProbe's ratio, whose
*low* values it prunes: its correlation should be positive to help), and the probe's
second-order estimate (the saliency decision), each at probe reductions 0.1 (the default:
the pool shrunk to 10%) and 0.9 (shrunk by 10%). The probe shrinks the whole pool of every
target matrix at once (K = all), as the stage does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prune_bench import base_config, train_dense  # noqa: E402  (the same model and data)

MATRICES = [
    "model.layers.1.self_attn.q_proj",
    "model.layers.2.mlp.down_proj",
    "model.layers.4.mlp.gate_proj",
    "model.layers.5.self_attn.o_proj",
]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def study(work: Path, samples: int, seed: int) -> dict[str, Any]:
    from harness import distributed as dist_utils
    from harness.config import load_config, load_strategy
    from harness.distributed import Collectives
    from harness.pruning import build_views
    from harness.pruning.methods import Rule, float_keys, select, wanda_scores, widen
    from harness.runner import build_run, calibration_batches, calibration_split

    cfg_dict = base_config(work, 4000, 64)
    trained = train_dense(work, cfg_dict)
    path = work / "signal.yaml"
    import yaml

    path.write_text(
        yaml.safe_dump(
            {
                **cfg_dict,
                "model": {"name": trained["hf"]},
                "steps": 1,
                "output_dir": str(work / "signal"),
                "checkpoint": {"overwrite": True},
                "prune": {**cfg_dict["prune"], "method": "gradprobe"},
            }
        )
    )
    cfg = load_config(str(path), ["strategy=ddp"])
    info = dist_utils.init_distributed(cfg.device)
    loop, _ = build_run(cfg, load_strategy("ddp"), info)
    engine, data = loop.engine, loop.data
    model = engine.module
    model.eval()
    comm = Collectives()
    samples_t, holdout = calibration_split(data, cfg)
    batches = calibration_batches(samples_t, cfg, info, comm)
    held = calibration_batches(torch.from_numpy(holdout[: samples_t.shape[0]].astype("int64")), cfg, info, comm)
    views = {v.name: v for v in build_views(model, "decoder_linears", comm)}
    lins = {n: m for n, m in model.named_modules() if n in views}

    def calib_loss(on: list[torch.Tensor] = batches) -> float:
        with torch.no_grad():
            return sum(float(engine.forward_loss(b).double()) for b in on)

    def grads() -> list[dict[str, torch.Tensor]]:
        out = []
        for b in batches:
            model.zero_grad(set_to_none=True)
            engine.forward_loss(b).backward()
            out.append({n: lins[n].weight.grad.detach().clone() for n in views})
        model.zero_grad(set_to_none=True)
        return out

    sumsq: dict[str, torch.Tensor] = {}
    hooks = [
        lins[n].register_forward_pre_hook(
            lambda mod, a, n=n: sumsq.__setitem__(n, sumsq.get(n, 0) + a[0].detach().reshape(-1, a[0].shape[-1]).double().square().sum(0))
        )
        for n in views
    ]
    g0 = grads()
    for h in hooks:
        h.remove()
    norms = {n: sumsq[n].sqrt() for n in views}
    wanda = {n: wanda_scores(lins[n].weight.detach().flatten(), views[n].layout, norms[n]).reshape(lins[n].weight.shape) for n in views}
    rule = widen(Rule("per_row", 0.5), 0.25)
    chosen = select(rule, [views[n].layout for n in views], [float_keys(wanda[n].flatten()) for n in views], comm, 32)
    pools = {n: m.reshape(lins[n].weight.shape) for n, m in zip(views, chosen)}
    dense = {n: lins[n].weight.detach().clone() for n in views}
    probes = {}
    for r in (0.1, 0.9):
        with torch.no_grad():
            for n in views:
                lins[n].weight[pools[n]] *= r
        probes[r] = grads()
        with torch.no_grad():
            for n in views:
                lins[n].weight.copy_(dense[n])
    base_loss, base_held = calib_loss(), calib_loss(held)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {"calib_loss_sum": base_loss, "matrices": {}}
    for name in MATRICES:
        w = dense[name]
        idx = pools[name].flatten().nonzero().flatten()
        pick = idx[torch.randperm(idx.numel(), generator=g)[:samples]]
        true = torch.empty(pick.numel(), dtype=torch.float64)
        true_held = torch.empty(pick.numel(), dtype=torch.float64)
        flat = lins[name].weight.data.view(-1)
        for k, i in enumerate(pick.tolist()):
            old = float(flat[i])
            flat[i] = 0.0
            true[k] = calib_loss() - base_loss
            true_held[k] = calib_loss(held) - base_held
            flat[i] = old
        wf = w.flatten()[pick].double()
        g0max = torch.stack([s[name].flatten()[pick].abs() for s in g0]).max(0).values.double()
        g0sum = torch.stack([s[name].flatten()[pick] for s in g0]).sum(0).double()
        scores = {
            "|W|": wf.abs(),
            "wanda": wanda[name].flatten()[pick].double(),
            "taylor |W|·sqrt(Σg²)": wf.abs() * torch.stack([s[name].flatten()[pick] for s in g0]).double().square().sum(0).sqrt(),
            "first order -g·w (summed gradient)": -g0sum * wf,
        }
        for r, gr in probes.items():
            g1max = torch.stack([s[name].flatten()[pick].abs() for s in gr]).max(0).values.double()
            g1sum = torch.stack([s[name].flatten()[pick] for s in gr]).sum(0).double()
            scores[f"G1/G0, reduction {r}"] = g1max / g0max.clamp(min=1e-30)
            scores[f"saliency, reduction {r}"] = -g0sum * wf + wf * (g0sum - g1sum) / (2 * (1 - r))
        out["matrices"][name] = {
            "samples": int(pick.numel()),
            "true_increase_mean": float(true.mean()),
            "true_increase_negative_share": float((true < 0).double().mean()),
            "spearman": {k: spearman(v, true) for k, v in scores.items()},
            "spearman_holdout": {k: spearman(v, true_held) for k, v in scores.items()},
            "calib_vs_holdout_increase": spearman(true, true_held),
        }
        for which in ("spearman", "spearman_holdout"):
            print(
                f"[signal] {name} {which}: " + ", ".join(f"{k} {v:+.3f}" for k, v in out["matrices"][name][which].items()),
                file=sys.stderr,
                flush=True,
            )
    dist_utils.teardown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/prune_bench")
    parser.add_argument("--samples", type=int, default=150, help="pool weights per matrix whose removal is measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pruning" / "signal.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = study(Path(args.work).resolve(), args.samples, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
