"""Every pruning method at its defaults, on real pretrained models, judged where no method was tuned.

    OMP_NUM_THREADS=2 python benchmarks/prune_compare.py --model gemma3-270m --seeds 0 1 2
    python benchmarks/prune_compare.py --table        # the markdown table of every row recorded

The user's command for each method, `python -m harness.prune model.name=<dir> prune.method=M
prune.sparsity=0.5 [prune.pattern=2:4] data.seq_len=256 prune.calib_samples=32
micro_batch_size=4`, run in one process per model (the same engine `harness.runner.build_run`
builds; the dense weights put back before every row) so that the model loads once:

- models: SmolLM2-135M and Gemma-3-270M (`real_model.py`; Gemma's layers alternate sliding-window
  and global attention, the methods' defaults were never chosen on it);
- methods: magnitude, wanda, sparsegpt, sparsegpt_fit, gradprobe, each with nothing but its
  defaults (no method gets a setting tuned for it here);
- calibration: 32 sequences of 256 tokens from the `calib` split, drawn by `--seeds`;
- in-domain perplexity: the first `--eval-batches` x 4 blocks of the `eval` split (documents
  disjoint from calibration's: `prune_real.disjointness`, checked);
- out-of-domain perplexity: the license texts of /usr/share/common-licenses (English legal prose,
  no Python), tokenized by the model's tokenizer into blocks of 256 with BOS first, as harness
  cuts the corpus; the first `--eval-batches` x 4 blocks.

Each row (perplexities, the prune's own seconds, the fit's guard verdicts) is appended to
`benchmarks/results/pruning/compare.jsonl` as it is produced; a row already there is not run again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import prune_real  # noqa: E402
import real_model  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "pruning" / "compare.jsonl"
METHODS = ["magnitude", "wanda", "sparsegpt", "sparsegpt_fit", "gradprobe"]
PATTERNS = {"50%": "unstructured", "2:4": "2:4"}
OUT_OF_DOMAIN = Path("/usr/share/common-licenses")


def out_of_domain_blocks(tokenizer_dir: str, seq: int, bos: int | None, n: int) -> np.ndarray:
    """`n` blocks of `seq` tokens of the license texts (each file once, sorted by name), BOS first."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids: list[int] = []
    for path in sorted(p for p in OUT_OF_DOMAIN.iterdir() if p.is_file() and not p.is_symlink()):
        ids += tok(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
    body = seq - (bos is not None)
    count = min(n, len(ids) // body)
    rows = [([bos] if bos is not None else []) + ids[i * body : (i + 1) * body] for i in range(count)]
    if count < n:
        raise SystemExit(f"{OUT_OF_DOMAIN} gives {count} blocks of {seq} tokens; {n} asked")
    return np.asarray(rows, dtype=np.int64)


def measure(model: str, seeds: list[int], patterns: list[str], methods: list[str], eval_batches: int, work: Path) -> None:
    from harness import distributed as dist_utils
    from harness.config import load_config, load_strategy
    from harness.distributed import Collectives
    from harness.runner import build_run, evaluate, preflight, prune_and_measure

    work.mkdir(parents=True, exist_ok=True)
    cfg_dict = prune_real.real_config(work, 32, 256, eval_batches)
    cfg_dict["model"] = {"name": str(real_model.prepare(name=model))}
    cfg_dict["prune"] = {"method": "wanda", "sparsity": 0.5, "calib_samples": 32}
    cfg_dict["output_dir"] = str(work / model)
    cfg_dict["checkpoint"] = {"overwrite": True}
    path = work / f"{model}.yaml"
    path.write_text(yaml.safe_dump(cfg_dict))
    cfg = load_config(str(path), ["strategy=ddp"])
    info = dist_utils.init_distributed(cfg.device)
    loop, _ = build_run(cfg, preflight(cfg, load_strategy("ddp")), info)
    engine, data = loop.engine, loop.data
    bos = getattr(data.blocks["eval"], "bos", None)  # harness puts it first in every block
    ood = out_of_domain_blocks(data.tokenizer_dir, cfg.data.seq_len, bos, eval_batches * cfg.micro_batch_size)
    data = dataclasses.replace(data, blocks={**data.blocks, "ood": ood})
    print(f"[compare] calibration vs eval documents: {prune_real.disjointness(data, [32], seeds)}", file=sys.stderr, flush=True)
    dense_state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

    def perplexities() -> dict[str, float]:
        return {
            "eval_perplexity": evaluate(engine, data, cfg, info)["eval/perplexity"],
            "ood_perplexity": evaluate(engine, data, cfg, info, split="ood")["eval/perplexity"],
        }

    done = {(r["model"], r["method"], r["pattern"], r["seed"], r["eval_tokens"]) for r in rows()}
    eval_tokens = eval_batches * cfg.micro_batch_size * cfg.data.seq_len
    if (model, "dense", "-", 0, eval_tokens) not in done:
        append({"model": model, "method": "dense", "pattern": "-", "seed": 0, "eval_tokens": eval_tokens, **perplexities()})
    dense = {"eval/loss": 0.0, "eval/perplexity": 0.0}  # prune_and_measure's 'before': not read here
    for seed in seeds:  # every method and pattern of one seed before the next seed
        for pattern in patterns:
            for method in methods if seed == seeds[0] else [m for m in methods if m != "magnitude"]:  # magnitude reads no data
                if (model, method, pattern, seed, eval_tokens) in done:
                    continue
                engine.module.load_state_dict(dense_state)
                prune = dataclasses.replace(cfg.prune, method=method, pattern=PATTERNS[pattern], calib_seed=seed)
                start = time.perf_counter()
                stats, _, _ = prune_and_measure(engine, data, dataclasses.replace(cfg, prune=prune), info, dense, Collectives())
                row = {
                    "model": model,
                    "method": method,
                    "pattern": pattern,
                    "seed": seed,
                    "eval_tokens": eval_tokens,
                    "prune_seconds": stats["wall_time_s"],
                    "with_eval_seconds": time.perf_counter() - start,
                    "achieved_sparsity": stats["achieved_sparsity"],
                    "fit": stats.get("details", {}).get("fit"),
                    "eval_perplexity": stats["eval_perplexity_after"],  # the stage's own evaluation after pruning
                    "ood_perplexity": evaluate(engine, data, cfg, info, split="ood")["eval/perplexity"],
                }
                append(row)
                print(
                    f"[compare] {model} {method:14s} {pattern:4s} seed {seed}: ppl {row['eval_perplexity']:.2f} "
                    f"ood {row['ood_perplexity']:.2f} {row['prune_seconds']:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )


def rows() -> list[dict[str, Any]]:
    return [json.loads(x) for x in RESULTS.read_text().splitlines() if x.strip()] if RESULTS.exists() else []


def append(row: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")


def table() -> str:
    """Per model and pattern: each method's mean (sd) over seeds, in-domain and out-of-domain, and
    its prune time against sequential SparseGPT's: the median over seeds of the two runs of the same
    seed (run one after the other in one process, so under the same load). A row recorded twice
    (a rerun) counts once: the last one."""
    out = []
    last = {(r["model"], r["method"], r["pattern"], r["seed"], r["eval_tokens"]): r for r in rows()}
    data = list(last.values())
    for model in sorted({r["model"] for r in data}):
        mine = [r for r in data if r["model"] == model]
        dense = next(r for r in mine if r["method"] == "dense")
        out.append(
            f"\n**{model}** (dense: eval {dense['eval_perplexity']:.2f}, out-of-domain {dense['ood_perplexity']:.2f}; "
            f"{dense['eval_tokens']:,} tokens each)\n"
        )
        out.append("| pattern | method | eval perplexity | out-of-domain | seeds | prune time vs SparseGPT's | fit kept |")
        out.append("|---|---|---:|---:|---:|---:|---:|")
        for pattern in PATTERNS:
            here = [r for r in mine if r["pattern"] == pattern]
            sgpt = {r["seed"]: r["prune_seconds"] for r in here if r["method"] == "sparsegpt"}
            for method in METHODS:
                rs = [r for r in here if r["method"] == method]
                if not rs:
                    continue

                def cell(key: str) -> str:
                    xs = [r[key] for r in rs]
                    m = statistics.mean(xs)
                    return f"{m:,.2f}" + (f" ({statistics.stdev(xs):.2f})" if len(xs) > 1 else "")

                paired = [r["prune_seconds"] / sgpt[r["seed"]] for r in rs if r["seed"] in sgpt]
                ratio = f"{statistics.median(paired):.2f}x" if paired else "-"
                fits = [f for r in rs for f in (r.get("fit") or [])]
                kept = f"{sum(f['kept'] == 'fit' for f in fits)}/{len(fits)}" if fits else "-"
                out.append(
                    f"| {pattern} | {method} | {cell('eval_perplexity')} | {cell('ood_perplexity')} | {len(rs)} | {ratio} | {kept} |"
                )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(real_model.MODELS), default="gemma3-270m")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=list(PATTERNS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument("--eval-batches", type=int, default=9, help="x 4 blocks of 256 tokens, in-domain and out-of-domain")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "prune_compare")
    parser.add_argument("--table", action="store_true", help="print the table of the recorded rows and exit")
    args = parser.parse_args()
    if args.table:
        print(table())
        return
    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    measure(args.model, args.seeds, args.patterns, args.methods, args.eval_batches, args.work)
    print(table())


if __name__ == "__main__":
    main()
