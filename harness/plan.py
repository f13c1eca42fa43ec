"""Plan a run before launching it: per-rank peak memory, the fastest config that fits, the longest sequence.

    python -m harness.plan --config run.yaml --gpus 8 --gpu-mem 48GiB [--cpu-mem 512GiB] [--nvme]
    python -m harness.plan --config run.yaml --gpus 8 --gpu-mem 48GiB --recommend [--out best.yaml]
    python -m harness.plan --config run.yaml --gpus 2 --gpu-mem 80GiB precision=bf16 micro_batch_size=2
    python -m harness.plan --config run.yaml --gpus 8 --gpu-mem 80GiB --cpu-mem 1TiB --max-seq-len

No GPU is needed and no weights are loaded: the model is built from its config with fake
storage and one training step is traced on rank 0 of a fake process group (see
``harness.planner``). Overrides are the trainer's ``key=value`` ones.

--recommend walks the memory ladder (``harness.planner.ladder``: precision, expert parallelism (a
mixture of experts under DDP), sharding, recomputation, chunked loss, tiled MLP, checkpoint-input
offload, sequence parallelism, optimizer in backward, offload, LoRA, QLoRA),
prints every rung and writes the first that fits. --max-seq-len finds the longest
``data.seq_len`` the config fits at (``harness.planner.long_context``), every other knob as written,
and never longer than the trainer takes for the model (its positions, ``model.max_seq_len``).
A mixture of experts' plan prints the worst routing case and the balanced one (``harness.planner.moe``);
the verdict uses the worst unless --routing balanced. Under expert parallelism (``parallel.expert``) the
plan is rank 0's: its share of the experts, and the rows the other ranks send it in each case.

Exit status (the table in harness/errors.py): 0 the config fits (or --recommend wrote one
that does); 10 it does not fit (something else would: see --recommend); 11 nothing fits
even with full offload; 2 bad input; 1 a bug.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from harness import imports_done  # the package first: as the program, the imports below run with the collector held

# isort: split
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config import ParallelLayout, Strategy, StrategyFacts, load_config, load_strategy, read_config_file, shipped_equivalent
from harness.errors import EXIT_OK, EXIT_PLAN_DOES_NOT_FIT, EXIT_PLAN_NOTHING_FITS, ConfigError, command_errors
from harness.planner import PlanError
from harness.planner.candidates import Candidate, most_frugal, with_candidate
from harness.planner.estimate import estimate, resolve_vocab
from harness.planner.ladder import CPU_ADAM_PARAMS_PER_S, PCIE_BYTES_PER_S, first_fit, format_ladder, offload_seconds, walk_ladder
from harness.planner.long_context import SEQ_STEP, format_search, max_seq_len
from harness.planner.moe import ROUTINGS
from harness.planner.params import param_info
from harness.planner.recommend import evaluate_lora, recommend, recommended_config, write_recommended
from harness.planner.report import format_estimate, gib, gpu_allowance, parse_size, verdict
from harness.planner.trace import build_fake_model


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="harness.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="run config (YAML or JSON); omitted: the trainer's defaults")
    parser.add_argument("--gpus", type=int, default=1, help="world size: GPUs (ranks) in the run")
    parser.add_argument("--gpu-mem", required=True, help="memory of one GPU, e.g. 48GiB, 80GB")
    parser.add_argument("--cpu-mem", help="host memory per node, e.g. 512GiB (checked for offload and model build)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="ranks sharing one node's host memory (default: --gpus)")
    parser.add_argument("--nvme", action="store_true", help="NVMe offload is available (lets --recommend use zero3_nvme)")
    parser.add_argument("--recommend", action="store_true", help="walk the memory ladder, print every rung, write the first that fits")
    parser.add_argument(
        "--fastest",
        action="store_true",
        help="with --recommend: search precision x AC x micro-batch x strategy x offload x sequence split for the fastest config that fits",
    )
    parser.add_argument(
        "--cpu-adam-rate",
        type=float,
        default=CPU_ADAM_PARAMS_PER_S,
        help="parameters per second the host's CPU Adam steps (offload rungs' step time; default: a published server figure)",
    )
    parser.add_argument(
        "--max-seq-len",
        action="store_true",
        help="find the longest data.seq_len this config fits at (device and host memory), by bisection over traced steps, "
        "at most the model's positions (max_position_embeddings) and model.max_seq_len",
    )
    parser.add_argument(
        "--seq-step", type=int, default=SEQ_STEP, help=f"with --max-seq-len: the answer's granularity in tokens (default {SEQ_STEP})"
    )
    parser.add_argument("--out", help="where --recommend writes the config (default: <config>.recommended.yaml)")
    parser.add_argument("--json", help="also write the result as JSON here")
    parser.add_argument(
        "--target",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda: plan for GPUs (default); cpu: plan a CPU run, where host and device are one memory",
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="vocabulary the trainer will use (default: resolved from the data)")
    parser.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="worst",
        help="a mixture of experts: the routing the verdict assumes; worst (default): every token of a micro-batch to the "
        "same top-k experts in every layer; balanced: each expert an equal share (both are printed)",
    )
    return parser.parse_known_args(argv)


def _estimate_json(est: Any, gpu_mem: int, cpu_mem: int | None, per_node: int) -> dict[str, Any]:
    v = verdict(est, gpu_mem, cpu_mem, per_node)
    allow = gpu_allowance(est)
    return {
        "engine": est.engine,
        "world_size": est.world_size,
        "rank": est.rank,
        "target": est.target,
        "peak_bytes": est.total,
        "peak_moment": est.peak.name,
        "peak_by_category": est.peak.categories,
        "moments": {m.name: m.total for m in est.moments},
        "allowance_bytes": {
            "cuda_context": allow.context,
            "nccl": allow.nccl,
            "workspaces": allow.workspaces,
            "fragmentation": allow.fragmentation,
            "total": allow.total,
        },
        "device_need_bytes": v.device_need,
        "host_bytes_per_rank": est.host,
        "host_step_peak_bytes": est.host_peak,
        "load_device_bytes": est.load_device,
        "load_host_bytes": est.load_host,
        "host_need_per_node_bytes": v.host_need_per_node,
        "fits": v.fits,
        "verdict": v.reason,
        "trace_seconds": est.trace_seconds,
        "params": est.params_total,
        "routing": _routing_json(est),
    }


def _routing_json(est: Any) -> dict[str, Any] | None:
    """A mixture of experts' routing cases (`harness.planner.moe.Routing`); None for a dense model."""
    r = est.routing
    if r is None:
        return None
    cases = {c: {"peak_bytes": r.peak(c, est.total), "busiest_expert_rows": r.busiest(c), "assumes": r.describe(c)} for c in ROUTINGS}
    return {
        "assumed": r.assumed,
        "experts": r.facts.experts,
        "top_k": r.facts.top_k,
        "expert_parallel": r.expert,
        "cases": cases,
        "why_equal": r.why_equal(),
    }


def _frugal_fits(
    cfg: Any, world: int, gpu_mem: int, cpu_mem: int | None, per_node: int, nvme: bool, target: str, vocab: int | None
) -> bool:
    """Does the most frugal configuration (bf16, full AC, micro-batch 1, everything offloaded) fit?"""

    est = estimate(with_candidate(cfg, most_frugal(cfg, world, nvme, target)), world, target=target, vocab_size=vocab)
    return verdict(est, gpu_mem, cpu_mem, per_node).fits


def _plan_lora(cfg: Any, args: argparse.Namespace, gpu_mem: int, cpu_mem: int | None, per_node: int, vocab: int | None) -> int:
    """A LoRA/QLoRA config, estimated with the LoRA model itself traced (`harness.planner.lora`).
    DeepSpeed's LoRA is planned as the torch engine that shards alike (ZeRO-3 as FSDP2, else DDP), said so."""
    mode = "lora" if cfg.lora.quantize == "none" else cfg.lora.quantize
    resolved = load_strategy(cfg.strategy)
    facts = StrategyFacts.of(resolved)
    own = resolved.name if shipped_equivalent(facts) == resolved.name else resolved.path  # a user's own file keeps its settings
    # a torch engine plans as itself; DeepSpeed as the torch engine that shards alike
    planned = own if facts.kind != "deepspeed" else "fsdp" if facts.shards_params else "ddp"
    c = Candidate(cfg.precision, cfg.memory.activation_checkpointing, cfg.micro_batch_size, cfg.grad_accum, planned, lora=mode)
    info = param_info(build_fake_model(cfg.model.name, vocab, FakeTensorMode()))
    ev = evaluate_lora(cfg, c, args.gpus, gpu_mem, args.target, vocab, info, cpu_mem=cpu_mem, per_node=per_node)
    title = f"Plan: {cfg.model.name} x {args.gpus} rank(s), {c.label()}"
    if facts.kind == "deepspeed":
        title += f" (strategy {resolved.name} planned as {planned}: LoRA under DeepSpeed is not modelled)"
    if ev.estimate is not None and (mode == "lora" or args.target == "cuda"):
        print(format_estimate(ev.estimate, gpu_mem, cpu_mem, per_node, title))
    else:
        print(title)
    print(f"  {ev.reason}")
    return EXIT_OK if ev.fits else EXIT_PLAN_DOES_NOT_FIT


def _kind_note(strategy: Strategy) -> str:
    """How a strategy that is not a shipped one is planned: as the shipped one with its facts."""
    facts = StrategyFacts.of(strategy)
    same = shipped_equivalent(facts)
    if same == strategy.name:
        return ""
    if same is not None:
        return f" (planned as {same}: the same engine, stage and offload)"
    return f" ({facts.kind}, stage {facts.stage}, offload optimizer {facts.offload_optimizer}, parameters {facts.offload_params})"


def _check_writable_file(flag: str, path: str) -> None:
    """`path` can be written as a file: not a directory, in a directory that exists and is writable."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise PlanError(f"{flag} '{path}' is a directory; give a file name (e.g. {os.path.join(path, 'plan.json')})")
    if not os.path.isdir(parent):
        raise PlanError(f"{flag} '{path}': directory '{parent}' does not exist (or is a file); create it or choose another path")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PlanError(f"{flag} '{path}' is not writable for this user; choose another path")


@command_errors("harness.plan", (ConfigError, PlanError))
def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only; never reach for a hub at planning time
    args, overrides = parse_args(argv)
    if args.gpus < 1:
        raise PlanError(f"--gpus must be >= 1 (the world size), got {args.gpus}")
    gpu_mem = parse_size(args.gpu_mem)
    cpu_mem = parse_size(args.cpu_mem) if args.cpu_mem else None
    per_node = args.gpus_per_node or args.gpus
    if per_node < 1:
        raise PlanError(f"--gpus-per-node must be >= 1, got {per_node}")
    unknown = [o for o in overrides if "=" not in o]
    if unknown:
        raise PlanError(f"unrecognised argument '{unknown[0]}' (options start with --, overrides are key=value)")
    for flag, target in (("--json", args.json), ("--out", args.out)):
        if target is not None:
            _check_writable_file(flag, target)  # before the plan's seconds of tracing, not after
    cfg = load_config(args.config, overrides)
    vocab = args.vocab_size or resolve_vocab(cfg)
    if args.fastest and not args.recommend:
        raise PlanError("--fastest chooses how --recommend searches: give --recommend too")
    if args.routing != "worst" and (args.recommend or args.max_seq_len or cfg.lora.enabled):
        raise PlanError(
            "--routing chooses the case of a full fine-tune's plan as written; --recommend, --max-seq-len and LoRA plan the worst case"
        )
    if args.max_seq_len:
        return _max_seq_len(args, cfg, gpu_mem, cpu_mem, per_node, vocab)
    if args.recommend and args.fastest:
        return _fastest(args, overrides, cfg, gpu_mem, cpu_mem, per_node, vocab)
    if args.recommend:
        return _recommend(args, overrides, cfg, gpu_mem, cpu_mem, per_node, vocab)
    if cfg.lora.enabled:
        return _plan_lora(cfg, args, gpu_mem, cpu_mem, per_node, vocab)
    strategy = load_strategy(cfg.strategy)  # resolved once: the plan, the title and the offload time read it
    est = estimate(cfg, args.gpus, target=args.target, vocab_size=vocab, strategy=strategy, routing=args.routing)
    cfg = est.config or cfg  # as the run resolves it: what the launcher and a DeepSpeed file set, taken in
    fits = verdict(est, gpu_mem, cpu_mem, per_node).fits
    if not fits and not _frugal_fits(cfg, args.gpus, gpu_mem, cpu_mem, per_node, args.nvme, args.target, vocab):
        print(
            f"harness.plan: error: nothing fits in {gib(gpu_mem)} per GPU x {args.gpus}, even bf16 + full activation "
            f"checkpointing + micro-batch 1 + {'NVMe' if args.nvme else 'CPU'} offload "
            f"(this config needs {gib(verdict(est, gpu_mem, cpu_mem, per_node).device_need)})",
            file=sys.stderr,
        )
        return EXIT_PLAN_NOTHING_FITS
    title = (
        f"Plan: {cfg.model.name} x {args.gpus} rank(s), strategy {strategy.name}{_kind_note(strategy)}, {cfg.precision}"
        f"{' (bf16 weights, no fp32 master)' if cfg.precision == 'bf16_pure' else ''}, optim {cfg.optim.name}, "
        f"micro-batch {cfg.micro_batch_size} x seq {cfg.data.seq_len}, AC {cfg.memory.activation_checkpointing}"
    )
    print(format_estimate(est, gpu_mem, cpu_mem, per_node, title))
    host_s = offload_seconds(cfg, est.params_total, args.gpus, per_node, args.cpu_adam_rate, strategy=strategy)
    if host_s:
        print(
            f"host's part of a step (offloaded optimizer): +{host_s:.3f} s, unoverlapped: CPU Adam at {args.cpu_adam_rate / 1e9:.2f}G "
            f"parameters/s per node (--cpu-adam-rate), PCIe {PCIE_BYTES_PER_S / 1e9:.0f} GB/s (assumed)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_estimate_json(est, gpu_mem, cpu_mem, per_node), f, indent=1)
    if fits:
        return EXIT_OK
    print("hint: run with --recommend for the fastest configuration that fits")
    return EXIT_PLAN_DOES_NOT_FIT


def _machine(args: argparse.Namespace, cpu_mem: int | None, per_node: int, vocab: int | None) -> dict[str, Any]:
    """What the ladder and the sequence search are told besides the ranks and the GPU memory: the host
    memory per node, the ranks sharing a node, the target and the vocabulary."""
    return {"cpu_mem": cpu_mem, "per_node": per_node, "target": args.target, "vocab_size": vocab}


def _max_seq_len(args: argparse.Namespace, cfg: Any, gpu_mem: int, cpu_mem: int | None, per_node: int, vocab: int | None) -> int:
    """The longest sequence the config fits at (`harness.planner.long_context`); exit 10 when not even one step of tokens does."""
    if args.recommend or args.seq_step < 1:
        raise PlanError(
            "--max-seq-len answers for the config as written: drop --recommend" if args.recommend else "--seq-step must be >= 1"
        )
    search = max_seq_len(
        cfg,
        args.gpus,
        gpu_mem,
        **_machine(args, cpu_mem, per_node, vocab),
        step=args.seq_step,
        on_probe=lambda p: print(f"  probe seq_len={p.seq_len:,}: {p.reason}", file=sys.stderr, flush=True),
    )
    strategy = load_strategy(cfg.strategy).name
    layout = ParallelLayout.of(cfg.parallel, args.gpus)
    title = (
        f"Longest sequence: {cfg.model.name} x {args.gpus} rank(s) of {gib(gpu_mem)}, strategy {strategy}, {cfg.precision}, "
        f"micro-batch {cfg.micro_batch_size}, AC {cfg.memory.activation_checkpointing}, loss chunk {cfg.memory.loss_chunk_size}, "
        f"tiled MLP {cfg.memory.tiled_mlp or cfg.memory.tiled_mlp_tokens and f'{cfg.memory.tiled_mlp_tokens} tokens' or 'off'}"
        + (f", {layout.describe()}" if layout.splits_sequences else "")
    )
    print(format_search(search, gpu_mem, title))
    if args.json:
        with open(args.json, "w") as f:
            probes = [
                {"seq_len": p.seq_len, "fits": p.fits, "device_bytes": p.device_need, "host_bytes_per_node": p.host_need}
                for p in search.probes
            ]
            capped = {"tokens": search.limit.tokens, "by": search.limit.source} if search.capped() and search.limit else None
            json.dump({"max_seq_len": search.longest, "step": search.step, "capped": capped, "probes": probes}, f, indent=1)
    return EXIT_OK if search.longest else EXIT_PLAN_DOES_NOT_FIT


def _recommend(
    args: argparse.Namespace, overrides: list[str], cfg: Any, gpu_mem: int, cpu_mem: int | None, per_node: int, vocab: int | None
) -> int:
    """Walk the memory ladder (`harness.planner.ladder`), print every rung, write the first that fits."""
    results = walk_ladder(
        args.config, overrides, args.gpus, gpu_mem, **_machine(args, cpu_mem, per_node, vocab), cpu_adam_rate=args.cpu_adam_rate
    )
    print(format_ladder(results, gpu_mem, cpu_mem, args.gpus, args.target, args.cpu_adam_rate))
    best = first_fit(results)
    if best is None:
        print(
            f"harness.plan: error: no rung of the memory ladder fits in {gib(gpu_mem)} per GPU x {args.gpus} "
            f"for {cfg.model.name}, not even QLoRA",
            file=sys.stderr,
        )
        return EXIT_PLAN_NOTHING_FITS
    print("")
    print(f"Best: {best.rung.name} ({' '.join(best.overrides[len(overrides) :]) or 'the config as written'})")
    for r in results[: results.index(best)]:
        print(f"  why: not '{r.rung.name}': {r.reason}")
    raw = read_config_file(args.config) if args.config else {}
    data = recommended_config(raw, best.overrides)
    out = args.out or (os.path.splitext(os.path.basename(args.config))[0] + ".recommended.yaml" if args.config else "recommended.yaml")
    header = (
        f"Written by harness.plan --recommend for {args.gpus} x {args.gpu_mem}: {best.rung.name}\n"
        f"{best.reason}\nLaunch: python -m harness.train --config {out}"
    )
    write_recommended(out, data, header)
    print(f"\nwrote {out}  (launch: python -m harness.train --config {out})")
    if best.estimate is not None:
        print("")
        print(format_estimate(best.estimate, gpu_mem, cpu_mem, per_node, f"Plan of the best: {best.rung.name}"))
    if args.json:
        with open(args.json, "w") as f:
            rows = [
                {
                    "rung": r.rung.name,
                    "fits": r.fits,
                    "device_bytes": r.device,
                    "host_bytes_per_node": r.host,
                    "relative_time": r.relative_time,
                    "offload_seconds": r.offload_s,
                    "reason": r.reason,
                }
                for r in results
            ]
            json.dump({"best": best.rung.name, "overrides": best.overrides, "config": out, "ladder": rows}, f, indent=1)
    return EXIT_OK


def _fastest(
    args: argparse.Namespace, overrides: list[str], cfg: Any, gpu_mem: int, cpu_mem: int | None, per_node: int, vocab: int | None
) -> int:
    """The fastest config that fits (`harness.planner.recommend`: the candidates walked by expected
    speed), rather than the ladder's first rung in memory order."""
    rec = recommend(cfg, args.gpus, gpu_mem, cpu_mem=cpu_mem, gpus_per_node=per_node, nvme=args.nvme, target=args.target, vocab_size=vocab)
    print(f"Searched {len(rec.evaluated)} configurations of {cfg.model.name} on {args.gpus} x {gib(gpu_mem)}, fastest first:")
    for ev in sorted(rec.evaluated, key=lambda e: e.cost):
        print(f"  {'fits ' if ev.fits else '     '} x{ev.cost:5.2f}  {ev.candidate.label():<68}  {ev.reason}")
    best = rec.best
    if best is None:
        print(f"harness.plan: error: nothing fits in {gib(gpu_mem)} per GPU x {args.gpus}, even with full offload", file=sys.stderr)
        return EXIT_PLAN_NOTHING_FITS
    print(f"\nBest: {best.candidate.label()}")
    for line in rec.why.get(best.candidate, []):
        print(f"  why: {line}")
    raw = read_config_file(args.config) if args.config else {}
    out = args.out or (os.path.splitext(os.path.basename(args.config))[0] + ".recommended.yaml" if args.config else "recommended.yaml")
    header = f"Written by harness.plan --recommend --fastest for {args.gpus} x {args.gpu_mem}: {best.candidate.label()}\n{best.reason}"
    write_recommended(out, recommended_config(raw, [*overrides, *best.candidate.overrides()]), header)
    print(f"\nwrote {out}  (launch: python -m harness.train --config {out})")
    return EXIT_OK


if __name__ == "__main__":
    imports_done()
    sys.exit(main())
