"""Search for the fastest configuration that fits: the memory decision tree, automated.

The tree (fp32 fits? -> mixed precision -> activation checkpointing -> smaller micro-batch
with accumulation -> ZeRO/FSDP stages -> offload) is searched whole, but walked in order of
*expected speed* rather than in the tree's fixed order: on several GPUs ZeRO-2 costs less
than recomputing activations, so it is tried first. Every branch of the tree is a
dimension here: precision x activation checkpointing x micro-batch (global batch kept by
gradient accumulation) x strategy stage x offload x sequence parallelism. The last is the
long-sequence branch: splitting each sample over N ranks (harness's Ulysses, torch engines
only) divides the activations that grow with the sequence by about N for a few all-to-alls, so
at long sequences it can beat recomputation; its degree is the user's own, or the largest the
world, ``data.seq_len`` and the model's heads allow (`sequence_degree`).

Expected speed and the candidates themselves (which combinations the trainer runs, with which
accumulation) are `harness.planner.candidates`'.

Candidates whose model state alone (no activations) cannot fit are rejected without a
trace; the others are estimated (traces are cached and shared by every strategy that runs
the bare module), until ``max_fits`` fitting configurations are found.

When no full fine-tune fits, the tree's last two steps follow, in order: LoRA (frozen bf16
base, adapters trained; `harness.planner.lora`) and QLoRA (NF4 base, bitsandbytes; sharded by
FSDP2 at world > 1). They change what is trained, not only how, so they are never chosen for
speed over a full fine-tune that fits; the first that fits is named.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config import (
    RunConfig,
    apply_overrides,
    facts_of,
    load_config,
    load_strategy,
    shipped_equivalent,
    shipped_facts,
)
from harness.planner.candidates import SPEED, Candidate, accum_for, candidates, lora_candidates, most_frugal, with_candidate
from harness.planner.estimate import Estimate, estimate, resolve_vocab, specs_for, walk
from harness.planner.model_states import engine_model, fsdp_local_numel
from harness.planner.params import ParamInfo, param_info
from harness.planner.report import CUDA_CONTEXT, FRAGMENTATION, LIBRARY_WORKSPACES, NCCL_BUFFERS, gib, verdict
from harness.planner.trace import TraceResult, build_fake_model
from harness.training import DTYPE_BYTES


@dataclass
class Evaluated:
    candidate: Candidate
    cost: float
    fits: bool
    need: int  # per-GPU bytes incl. allowance (or the model-state lower bound when pruned)
    reason: str
    estimate: Estimate | None = None


@dataclass
class Recommendation:
    fits: list[Evaluated]
    evaluated: list[Evaluated]
    why: dict[Candidate, list[str]] = field(default_factory=dict)

    @property
    def best(self) -> Evaluated | None:
        return self.fits[0] if self.fits else None


def _model_state_floor(cfg: RunConfig, world: int, target: str, info: ParamInfo, vocab: int | None) -> int:
    """Per-rank peak with zero activations: a lower bound that needs no trace."""
    strategy = load_strategy(cfg.strategy)
    tspec, espec = specs_for(cfg, strategy, world, info.hidden_size, target, vocab)
    info = info.split(tspec.expert)  # each rank its share of the experts
    if tspec.wrap == "fsdp":  # each rank's expert range sharded over its replicas, the rest over the world
        replicas = world // tspec.expert
        params = sum(fsdp_local_numel(s, replicas if n in info.split_names else world, 0) for n, s in zip(info.names, info.shapes)) * 4
        grads = params
    else:
        params = info.total * DTYPE_BYTES.get(tspec.module_dtype, 4)
        grads = params
    rows = [(params, 0, 0, 0, 0, 0, 0, 0), (params, 0, grads, 0, 0, 0, 0, 0)]
    synthetic = TraceResult(tspec, rows, [0, 1], [0, 0], ["model"], info)
    em = engine_model(espec, info, 0)
    return max(m.total for m in walk(synthetic, em, cpu_run=target == "cpu"))


def recommend(
    cfg: RunConfig,
    world: int,
    gpu_mem: int,
    *,
    cpu_mem: int | None = None,
    gpus_per_node: int | None = None,
    nvme: bool = False,
    target: str = "cuda",
    vocab_size: int | None = None,
    max_fits: int = 5,
    max_traced: int = 40,
    info: ParamInfo | None = None,
) -> Recommendation:
    """Walk the candidates fastest-first; estimate those whose model state could fit; keep the fitting ones."""

    per_node = gpus_per_node or world
    vocab = vocab_size or resolve_vocab(cfg)
    info = info or _param_info(cfg.model.name, vocab)
    results: dict[Candidate, Evaluated] = {}
    fits: list[Evaluated] = []
    traced = 0

    def evaluate(c: Candidate) -> Evaluated:
        nonlocal traced
        if c in results:
            return results[c]
        if c.lora != "none":
            results[c] = evaluate_lora(cfg, c, world, gpu_mem, target, vocab, info, cpu_mem=cpu_mem, per_node=per_node)
            return results[c]
        run = with_candidate(cfg, c)
        cost = c.cost(cfg.micro_batch_size)
        floor = _model_state_floor(run, world, target, info, vocab)
        floor_need = floor + (gpu_allowance_for(floor, world) if target == "cuda" else 0)
        if floor_need > gpu_mem:
            ev = Evaluated(c, cost, False, floor_need, f"model state + GPU allowance alone need {gib(floor_need)} > {gib(gpu_mem)}")
        else:
            est = estimate(run, world, target=target, vocab_size=vocab)
            traced += 1
            v = verdict(est, gpu_mem, cpu_mem, per_node)
            ev = Evaluated(c, cost, v.fits, v.device_need, v.reason, est)
        results[c] = ev
        return ev

    ordered = candidates(cfg, world, nvme, target, vocab)
    for c in ordered:
        if len(fits) >= max_fits or traced >= max_traced:
            break
        ev = evaluate(c)
        if ev.fits:
            fits.append(ev)
    if not fits:
        # The trace budget may end before the slowest, most frugal corner: settle "nothing fits" there.
        frugal = evaluate(most_frugal(cfg, world, nvme, target))
        if frugal.fits:
            fits.append(frugal)
    full_fits = bool(fits)
    for c in [] if fits else lora_candidates(cfg, world):  # the tree's last steps, in order: the first that fits
        ev = evaluate(c)
        if ev.fits:
            fits.append(ev)
            break
    rec = Recommendation(fits, list(results.values()))
    for ev in fits[:1]:
        rec.why[ev.candidate] = explain(cfg, ev.candidate, evaluate)
        if not full_fits:
            rec.why[ev.candidate].insert(
                0,
                "no full fine-tune fits, not even the most frugal (bf16, full recomputation, "
                "micro-batch 1, everything offloaded): the adapters train, the base is frozen",
            )
    return rec


def evaluate_lora(
    cfg: RunConfig,
    c: Candidate,
    world: int,
    gpu_mem: int,
    target: str,
    vocab: int | None,
    info: ParamInfo,
    cpu_mem: int | None = None,
    per_node: int = 1,
) -> Evaluated:
    """A LoRA/QLoRA candidate, estimated like any config: the LoRA model itself is traced
    (`harness.planner.lora`); QLoRA's quantized base is a formula over that trace."""
    cost = c.cost(cfg.micro_batch_size)
    run = with_candidate(cfg, c)
    est = estimate(run, world, target=target, vocab_size=vocab)
    v = verdict(est, gpu_mem, None, per_node)
    adapters = f"{est.params_total / 1e6:.2f}M adapter parameters (r={cfg.lora.r})"
    if not v.fits:
        return Evaluated(c, cost, False, v.device_need, f"{v.reason} ({adapters})", est)
    # LoRA and QLoRA under torch's engines are built on the meta device and filled (QLoRA: quantized)
    # a tensor at a time, like a full fine-tune, and so is ZeRO-3's base (under zero.Init); ZeRO-1/2
    # build the frozen base whole in fp32 on the host.
    facts = shipped_facts(c.strategy)
    meta_built = facts.kind != "deepspeed" or facts.stage == 3
    host = (info.whole_largest if meta_built else info.total + info.frozen) * 4 * per_node
    if cpu_mem is not None and host > cpu_mem:
        return Evaluated(c, cost, False, v.device_need, f"needs {gib(host)} host memory per node to build the model > {gib(cpu_mem)}", est)
    return Evaluated(
        c,
        cost,
        True,
        v.device_need,
        f"fits: {gib(v.device_need)} of {gib(gpu_mem)} per {'GPU' if target == 'cuda' else 'rank'} "
        f"({adapters}; parameters incl. the frozen base {gib(est.peak.categories['parameters'])})",
        est,
    )


def gpu_allowance_for(peak: int, world: int) -> int:
    """The report's GPU allowance for a bare number (used on lower bounds)."""

    return CUDA_CONTEXT + (NCCL_BUFFERS if world > 1 else 0) + LIBRARY_WORKSPACES + int(FRAGMENTATION * peak)


def explain(cfg: RunConfig, chosen: Candidate, evaluate: Any) -> list[str]:
    """For each way ``chosen`` departs from the user's config: what undoing only that change costs.
    The user's strategy is the shipped one with its resolved facts (a DeepSpeed run launched without
    `strategy:`, or a user's own file, is compared as the DeepSpeed stage and offload it is)."""
    own = facts_of(cfg.strategy)
    user = {
        "precision": cfg.precision,
        "ac": cfg.memory.activation_checkpointing,
        "micro_batch": cfg.micro_batch_size,
        "strategy": shipped_equivalent(own) or cfg.strategy or own.kind,
        "sequence": cfg.parallel.sequence,
    }
    names = {
        "precision": "precision",
        "ac": "activation checkpointing",
        "micro_batch": "micro-batch",
        "strategy": "strategy",
        "sequence": "sequence split (ranks per sample)",
    }
    reasons = []
    for dim, theirs in user.items():
        ours = getattr(chosen, dim)
        if ours == theirs:
            continue
        if dim == "ac" and theirs not in SPEED["ac"]:
            continue
        if dim == "strategy" and shipped_equivalent(own) is None:
            reasons.append(f"{names[dim]} {theirs} -> {ours}: a shipped strategy the planner can rank")
            continue
        back = replace(chosen, **{dim: theirs})
        back = replace(back, grad_accum=accum_for(cfg, back.micro_batch, back.sequence))
        ev = evaluate(back)
        if ev.fits:
            reasons.append(
                f"{names[dim]} {theirs} -> {ours}: expected faster ({ev.cost / chosen.cost(cfg.micro_batch_size):.2f}x "
                "the step time with the change undone), both fit"
            )
        else:
            reasons.append(f"{names[dim]} {theirs} -> {ours}: without this change {ev.reason}")
    return reasons


def _param_info(model_name: str, vocab: int | None) -> ParamInfo:
    return param_info(build_fake_model(model_name, vocab, FakeTensorMode()))


def recommended_config(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The user's config file contents + their overrides + the chosen settings' (after them), as a config mapping."""
    data = apply_overrides(copy.deepcopy(raw), list(overrides))
    data.pop("global_batch_size", None)  # implied by micro * accum * world; a stale value would contradict
    return data


def write_recommended(path: str, data: dict[str, Any], header: str) -> None:
    """Write the config as YAML and load it back with the trainer's loader: it must launch as is."""
    with open(path, "w") as f:
        f.write("".join(f"# {line}\n" for line in header.splitlines()))
        yaml.safe_dump(data, f, sort_keys=False, default_flow_style=False)
    load_config(path)


__all__ = [
    "Evaluated",
    "Recommendation",
    "evaluate_lora",
    "explain",
    "recommend",
    "recommended_config",
    "write_recommended",
]
