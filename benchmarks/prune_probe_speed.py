"""What one GradProbe probe pass costs on SmolLM2-135M, by how deep the probed matrix sits.

    OMP_NUM_THREADS=1 python benchmarks/prune_probe_speed.py --out runs/prune_probe_speed

Built as `prune_bench.py --model smollm2-135m` builds its world-1 run (`harness.runner.build_run`,
strategy ddp at world 1, i.e. the bare module; the engine's own loss; 32 calibration sequences of
256 in micro-batches of 4). For the MLP up-projection of each block in `--blocks`, one pass of
`gradient_max` over the calibration steps (the unit GradProbe's original mode spends 2 of per
matrix, 420 in all on this model) is timed three ways, in one process, one after the other:

- `full`: the full forward and backward (`Runner(probed_only=False)`: what every pass cost before);
- `probed`: the backward asks autograd for the probed weight alone, so it stops at that block and
  computes no other weight gradient (the prefix cache switched off);
- `replayed`: as `probed`, and the blocks below are replayed from an earlier pass (timed after a
  capturing pass, which costs what `probed` costs).

The three statistics must be bit-identical (the script fails otherwise). The original mode's
estimated wall time follows from the measured depths, linearly interpolated over the 30 blocks:
before, 14 `full` passes per block; now, per block, one `probed` pass (it captures) and 13 `replayed`.
Writes `<out>/probe_speed.json` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import prune_real  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from harness import distributed as dist_utils  # noqa: E402
from harness.config import load_config, load_strategy  # noqa: E402
from harness.distributed import Collectives  # noqa: E402
from harness.pruning import build_views  # noqa: E402
from harness.pruning.calibration import Runner, gradient_max  # noqa: E402
from harness.runner import build_run, calibration_batches, calibration_split, preflight  # noqa: E402

MATRIX = "mlp.up_proj"
PASSES_PER_BLOCK = 14  # the original mode: G0 and G1 for each of a Llama block's 7 matrices


def timed_pass(runner: Runner, steps: list[list[Any]], views: list[Any]) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    g = gradient_max(runner, steps, views, torch.float32)
    return time.perf_counter() - t0, g[views[0].name]


def measure(out: Path, blocks: list[int], calib: int, data_cache: str | None) -> dict[str, Any]:
    cfg_dict = prune_real.real_config(out, calib, 256, 1)
    cfg_dict.update(output_dir=str(out / "run"), checkpoint={"overwrite": True})
    cfg_dict["prune"]["method"] = "gradprobe"  # read only for the calibration split; nothing is pruned
    if data_cache:  # the tokenized corpus of an earlier benchmark, instead of tokenizing again
        cfg_dict["data"]["cache_dir"] = data_cache
    path = out / "probe_speed.yaml"
    path.write_text(yaml.safe_dump(cfg_dict))
    cfg = load_config(str(path), ["strategy=ddp"])
    info = dist_utils.init_distributed(cfg.device)
    loop, _ = build_run(cfg, preflight(cfg, load_strategy("ddp")), info)
    engine, comm = loop.engine, Collectives()
    samples, _ = calibration_split(loop.data, cfg)
    batches = calibration_batches(samples, cfg, info, comm)
    loss_fn = lambda _, b: engine.forward_loss(b)
    views = build_views(engine.model, "decoder_linears", comm)
    layers = max(v.target.unit for v in views) + 1
    rows = []
    with engine.backward_without_step():
        engine.module.eval()
        steps = Runner(engine.model, loss_fn, cfg.grad_accum).steps(batches)
        for block in blocks:
            view = [v for v in views if v.target.unit == block and v.name.endswith(MATRIX)]
            full_s, g_full = timed_pass(Runner(engine.model, loss_fn, cfg.grad_accum, probed_only=False), steps, view)
            probed = Runner(engine.model, loss_fn, cfg.grad_accum)
            probed.prefix.enabled = False
            probed_s, g_probed = timed_pass(probed, steps, view)
            cached = Runner(engine.model, loss_fn, cfg.grad_accum)
            capture_s, _ = timed_pass(cached, steps, view)
            # The runner checks its first replay against one more full forward; this script checks
            # every statistic against the full pass instead, so the steady pass is what gets timed.
            cached.prefix.verified = True
            replayed_s, g_replayed = timed_pass(cached, steps, view)
            if not (torch.equal(g_full, g_probed) and torch.equal(g_full, g_replayed)):
                raise SystemExit(f"block {block}: the statistics differ between the three ways")
            row = {
                "block": block,
                "matrix": view[0].name,
                "full_s": full_s,
                "probed_s": probed_s,
                "capture_s": capture_s,
                "replayed_s": replayed_s,
                "replayed_micro_batches": cached.prefix.replays,
            }
            rows.append(row)
            print(f"[probe_speed] {json.dumps(row)}", file=sys.stderr, flush=True)
    depth = np.arange(layers)
    at = [r["block"] for r in rows]
    per_block = {k: np.interp(depth, at, [r[k] for r in rows]) for k in ("full_s", "probed_s", "replayed_s")}
    before = float(PASSES_PER_BLOCK * per_block["full_s"].sum())
    after = float((per_block["probed_s"] + (PASSES_PER_BLOCK - 1) * per_block["replayed_s"]).sum())
    return {
        "model": "smollm2-135m",
        "calib_samples": calib,
        "micro_batch_size": cfg.micro_batch_size,
        "seq_len": cfg.data.seq_len,
        "threads": torch.get_num_threads(),
        "layers": layers,
        "rows": rows,
        "original_mode_estimate_s": {"before": before, "after": after, "speedup": before / after},
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| block | full pass (s) | probed backward (s) | + lower blocks replayed (s) | speedup |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        speedup = r["full_s"] / r["replayed_s"]
        lines.append(f"| {r['block']} | {r['full_s']:.1f} | {r['probed_s']:.1f} | {r['replayed_s']:.1f} | {speedup:.2f}x |")
    e = result["original_mode_estimate_s"]
    lines.append(
        f"\nOriginal mode ({result['layers']} blocks x {PASSES_PER_BLOCK} passes), interpolated: "
        f"{e['before'] / 3600:.2f} h before, {e['after'] / 3600:.2f} h now ({e['speedup']:.2f}x)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/prune_probe_speed")
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 10, 20, 29])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--data-cache", default=None, help="a data cache_dir to reuse (e.g. runs/prune_bench_smollm2/cache)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = measure(out, sorted(args.blocks), args.calib_samples, args.data_cache)
    (out / "probe_speed.json").write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
