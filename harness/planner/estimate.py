"""Per-rank peak memory of a run config: the traced step with the engine's model state laid over it.

``estimate(cfg, world_size)`` resolves what the trainer would do with the config
(strategy file, precision policy, DeepSpeed "auto" values, vocabulary), traces forward +
backward once, and walks the traced per-op timeline with the engine's
:class:`~harness.planner.model_states.EngineModel`: every op's live bytes get the engine's
parameters, gradients, buckets and resident optimizer state; the analytic phases after
backward (gradient reduction, optimizer step) are added as further moments. The peak is
the largest of all moments, on the worst rank.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config import (
    LoraConfig,
    RunConfig,
    Strategy,
    aux_loss_coefficient,
    check_run,
    check_sequence_heads,
    engine_kind,
    load_strategy,
)
from harness.data import cache_dir_for
from harness.engine import EnginePlan, plan_engine
from harness.errors import ConfigError
from harness.models import is_preset
from harness.planner.load_phase import load_phase_bytes
from harness.planner.lora import quantized_base
from harness.planner.model_states import EngineModel, EngineSpec, engine_model, zero12_partition
from harness.planner.moe import ROUTINGS, Routing
from harness.planner.params import ParamInfo
from harness.planner.result import REPORT_CATS, Estimate, Moment
from harness.planner.trace import CATS, PlanError, TraceResult, TraceSpec, adapter_key, build_fake_model, trace_step
from harness.planner.traffic import planned_traffic
from harness.training import DTYPE_BYTES, DTYPE_NAMES, name_compiles_step

# ----------------------------------------------------------------------------- config → specs


def resolve_vocab(cfg: RunConfig) -> int | None:
    """The vocabulary the trainer will give the model (presets follow the data's tokenizer)."""

    if not is_preset(cfg.model.name):
        return None  # a local model: its own config decides
    try:
        meta = os.path.join(cache_dir_for(cfg.model.name, cfg.data), "meta.json")
        if os.path.exists(meta):
            with open(meta) as f:
                return int(json.load(f)["vocab_size"])
    except (ImportError, AttributeError, OSError, ValueError, KeyError):
        pass
    return cfg.data.vocab_size if not cfg.data.tokenizer else None


def _plannable_strategy(strategy: Strategy) -> Strategy:
    """An NVMe path is the launch machine's business: validate everything else here."""
    raw = copy.deepcopy(strategy.raw)
    for key in ("offload_optimizer", "offload_param"):
        block = (raw.get("zero_optimization") or {}).get(key) or {}
        if block.get("device") == "nvme":
            block["nvme_path"] = tempfile.gettempdir()
    return Strategy(**{**strategy.__dict__, "raw": raw})


def plan_for(cfg: RunConfig, strategy: Strategy, world: int, hidden: int) -> EnginePlan:
    """The engine plan the trainer's pre-flight makes (`harness.engine.plan_engine`: the same kind
    rule, DeepSpeed dict and precision policy), for a machine that need not exist here: one with
    GPUs, so a DeepSpeed fp16 run plans as it would run there."""
    return plan_engine(cfg, _plannable_strategy(strategy), world, torch.device("cpu"), hidden, has_accelerator=True)


def deepspeed_zero(plan: EnginePlan) -> Any:
    """The plan's zero_optimization block with every key the file leaves out filled by DeepSpeed's
    own defaults (its pydantic config model)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(**(plan.deepspeed or {}).get("zero_optimization", {}))


def check_modelled(lora: LoraConfig, strategy: Strategy, world: int) -> str:
    """The engine kind, or PlanError where the planner does not model the strategy (ZeRO-0, LoRA
    under DeepSpeed)."""
    kind = engine_kind(strategy.kind, world)
    if kind == "deepspeed" and strategy.zero_stage == 0:
        raise PlanError(f"{strategy.name}: DeepSpeed ZeRO stage 0 is not modelled by the planner; use ddp.json")
    if lora.enabled and kind == "deepspeed":
        raise PlanError(f"lora.enabled=true under {strategy.name}: LoRA is planned under ddp or fsdp (torch's engines) only")
    return kind


def specs_for(
    user: RunConfig, strategy: Strategy, world: int, info_hidden: int, target: str, vocab: int | None, plan: EnginePlan | None = None
) -> tuple[TraceSpec, EngineSpec]:
    """What is traced and what the engine formulas take, for the run config as the run resolves it
    (`plan`'s config; default: planned here, as pre-flight plans it)."""
    kind = check_modelled(user.lora, strategy, world)
    lora = user.lora
    plan = plan or plan_for(user, strategy, world, info_hidden)
    cfg = plan.config
    policy = plan.precision
    param_dtype = DTYPE_NAMES[policy.param_dtype]
    module_dtype = cfg.precision if kind == "deepspeed" and cfg.precision != "fp32" else param_dtype
    trace = TraceSpec(
        model_name=cfg.model.name,
        vocab_size=vocab,
        world_size=world if kind == "fsdp" else 1,
        micro_batch=cfg.micro_batch_size,
        seq_len=cfg.data.seq_len,
        precision=cfg.precision,
        wrap="fsdp" if kind == "fsdp" else "plain",
        module_dtype=module_dtype if kind != "fsdp" else param_dtype,
        reshard_after_forward=strategy.reshard_after_forward,
        fsdp_reduce_dtype=strategy.reduce_dtype,
        ac_mode=cfg.memory.activation_checkpointing,
        ac_every=cfg.memory.ac_every,
        loss_chunk_size=cfg.memory.loss_chunk_size,
        # on a CPU run the host is the device: the offload holds the same bytes by reference
        offload_checkpoint_inputs=cfg.memory.offload_checkpoint_inputs and target == "cuda",
        mlp_tiles=(cfg.memory.tiled_mlp if cfg.memory.tiled_mlp > 1 else 0, cfg.memory.tiled_mlp_tokens),
        micro_batches=2 if cfg.grad_accum > 1 else 1,
        autocast=policy.autocast and kind != "deepspeed",
        lora=adapter_key(lora) if lora.enabled else None,
        # QLoRA: the codes are stored in the compute dtype (harness.models.qlora), gathered and dequantized as such
        nf4_storage=DTYPE_NAMES[policy.compute_dtype] if lora.enabled and lora.quantize == "nf4" else None,
        frozen_dtype=DTYPE_NAMES[policy.frozen_dtype] if lora.enabled and policy.frozen_dtype != policy.param_dtype else None,
        sequence=plan.layout.sequence,
        packed=cfg.data.packs_examples,
        expert=plan.layout.expert,
        aux_loss_coef=aux_loss_coefficient(cfg.moe),
    )
    common = dict(
        kind=kind,
        world=world,
        precision=cfg.precision,
        stage=strategy.zero_stage,
        offload_optimizer=strategy.offload_optimizer,
        offload_params=strategy.offload_params,
        optimizer=cfg.optim.name,
        weight_decay=cfg.optim.weight_decay,
        optimizer_in_backward=cfg.memory.optimizer_in_backward,
        target=target,
        compiled_step=name_compiles_step(cfg.optim.name),
        # LoRA/QLoRA adapters too: the trainer casts all but the quantized linears (`cast_except_quantized`)
        torch_param_bytes=DTYPE_BYTES[param_dtype],
        frozen_param_bytes=DTYPE_BYTES[DTYPE_NAMES[policy.frozen_dtype]],
        expert=plan.layout.expert,
    )
    if kind != "deepspeed":
        return trace, EngineSpec(**common)
    zero = deepspeed_zero(plan)
    off = zero.offload_param
    engine = EngineSpec(
        **common,
        cpu_adam=True if plan.cpu_adam_forced else None,  # else by target: the planner's plan assumes a GPU
        reduce_bucket=int(zero.reduce_bucket_size),
        contiguous_gradients=bool(zero.contiguous_gradients),
        persistence_threshold=int(zero.param_persistence_threshold),
        max_live=int(zero.max_live_parameters),
        sub_group_size=int(zero.sub_group_size),
        nvme_buffer_count=int(off.buffer_count) if off is not None else 5,
        nvme_buffer_size=int(off.buffer_size) if off is not None else 100_000_000,
        pin_optimizer=zero.offload_optimizer is not None and bool(zero.offload_optimizer.pin_memory),
        pin_params=off is not None and bool(off.pin_memory),
    )
    return trace, engine


# ----------------------------------------------------------------------------- combining


def _report_row(row: tuple[int, ...]) -> dict[str, int]:
    cats = dict(zip(CATS, row))
    out = {c: cats.get(c, 0) for c in REPORT_CATS}
    out["other"] = cats["other"] + cats["model_buffers"]
    return out


def _add(cats: dict[str, int], extra: dict[str, int]) -> dict[str, int]:
    out = dict(cats)
    for key, value in extra.items():
        out[key if key in out else "other"] = out.get(key if key in out else "other", 0) + value
    return out


def collective_race_bytes(trace: TraceResult, cpu_run: bool, row: int | None = None) -> int:
    """Bytes a real run may or may not hold at op ``row`` (None: past the last op), depending on
    thread scheduling alone.

    gloo runs each collective on a worker thread, which signals completion and only then drops
    its own reference to the op's tensors. FSDP2 frees a collective's buffer (the all-gather
    output once copied into the parameters, the reduce-scatter input once scattered) by dropping
    its last Python reference right after the wait returns; when the worker thread has not run
    since signalling (a loaded machine), the buffer outlives that point until it does. Measured
    on tiny-llama at world 2 (notes/planner_accuracy.md): the LM head's 512 KiB all-gather
    output, the last collective before the loss, still alive at the loss, the step's peak, in
    some runs. So at each op the plan includes the last collective's buffer once the step has
    freed it, and a run peaks anywhere in ``[total - race, total]``. Not the step's largest
    buffer at every op, nor an earlier collective's: under tied embeddings the largest is the
    root group's (the whole embedding, on a 262k vocabulary), gathered again at the start of
    backward behind a prefetched block's and reduce-scattered at its end; counting it at the
    loss planned 17-25% high, and no measured step held it (notes/planner_accuracy.md).
    FSDP2 only: DDP's buckets are resident and neither DDP nor DeepSpeed has shown it in the
    accuracy tests; NCCL is not modelled (CUDA plans get 0). Gloo can keep more than one, which no
    plan counts: ranks that outnumber the cores (three on two: up to five of SmolLM2's 14 MB layer
    buffers at once) and Ulysses' all-to-all buffers (notes/planner_accuracy.md).
    """
    if not cpu_run or trace.spec.wrap != "fsdp" or trace.spec.world_size < 2:
        return 0
    if row is None:
        return trace.race_after_backward
    return trace.race[row] if row < len(trace.race) else 0


def walk(trace: TraceResult, em: EngineModel, cpu_run: bool = False) -> list[Moment]:
    """Forward/backward peak, end of backward and the analytic phases of one rank.

    Each traced op's bytes get the engine's parameters and gradients in place of the bare
    module's, the bucket once the first gradient exists, then the resident state. On a CPU
    run the host *is* the device: offloaded state and the host-side step count there too,
    gloo's reduce-scatter copy (NCCL has none) is added inside that collective, and every
    moment carries the collective buffer gloo's worker may still hold there (:func:`collective_race_bytes`).
    """

    def finish(cats: dict[str, int], host_extra: int = 0, race: int = 0) -> dict[str, int]:
        out = _add(cats, em.resident)
        if cpu_run:
            out = _add(out, em.host)
            out["optimizer_state"] += host_extra
            out["communication"] += race
        return out

    best: Moment | None = None
    seen_grad = False
    base_last: dict[str, int] = {}
    previous_grads = 0
    prev_full: dict[str, int] | None = None
    accumulating = trace.spec.micro_batches > 1
    for i, row in enumerate(trace.rows):
        cats = _report_row(row)
        traced_grads = cats["gradients"]
        seen_grad = seen_grad or traced_grads > 0
        if em.params_held is not None:
            cats["parameters"] += em.params_held - trace.held_param_bytes
        elif em.params is not None:
            cats["parameters"] = em.params
        if em.grads is not None and accumulating and em.accumulates_beside_buckets:
            # the buckets, and autograd's own accumulated gradients beside them (`no_sync` micro-batches)
            cats["gradients"] = em.grads - em.grads_made_in_backward + traced_grads
        elif em.grads is not None and em.grads_made_in_backward:
            # the buffers from the start, and autograd's gradients as the trace makes them (at most the traced ones)
            cats["gradients"] = em.grads - em.grads_made_in_backward + min(em.grads_made_in_backward, traced_grads)
        elif em.grads is not None:
            cats["gradients"] = em.grads if (seen_grad or em.grads_from_start) else 0
        elif em.sharded_grads_on_host and trace.sharded_grads:
            cats["gradients"] = max(0, traced_grads - trace.sharded_grads[i])
        if seen_grad:
            cats["communication"] += em.bucket
        new = max(0, traced_grads - previous_grads) if em.optimizer_in_backward else 0
        if em.optimizer_in_backward and not accumulating:
            cats["gradients"] = 0  # stepped by its hook and freed before the next op
        if new and prev_full is not None:
            # Optimizer in backward: the hook steps the new gradient right after the op that made it,
            # while that op's buffers (the gradient itself, a reduce-scatter's input) are still alive.
            hook = dict(prev_full)
            hook["temporaries"] += min(int(em.oib_step_per_grad_byte * new), em.oib_step_cap)
            if best is None or sum(hook.values()) > best.total:
                best = Moment(
                    trace.moment(i - 1) + " (optimizer step in the gradient hook)", hook, collective_race_bytes(trace, cpu_run, i - 1)
                )
        previous_grads = traced_grads
        base_last = cats
        race = collective_race_bytes(trace, cpu_run, i)
        full = finish(cats, race=race)
        if cpu_run and i in trace.gloo_extra:
            full["communication"] += trace.gloo_extra[i]
        if best is None or sum(full.values()) > best.total:
            best = Moment(trace.moment(i), full, race)
        prev_full = full
    moments = [best] if best is not None else []
    end = dict(base_last)
    if em.end_params is not None:
        end["parameters"] = em.end_params
    if em.end_grads is not None:
        end["gradients"] = em.end_grads
    if seen_grad:
        end["communication"] -= em.bucket
    if trace.spec.wrap == "fsdp":
        # FSDP2's root post-backward callback (after the last op the trace sees) reshards every
        # group and releases the reduce-scatter inputs it retained: no collective buffer is left
        # into the optimizer step (measured at world 2: the step's peak is the held state plus the
        # step's temporaries, to 0.03%; notes/optimizers.md). gloo's possible one is `finish`'s race.
        end["communication"] = 0
    end["temporaries"] = 0
    race = collective_race_bytes(trace, cpu_run)
    moments.append(Moment("end of backward", finish(end, race=race), race))
    for phase in em.phases:
        cats = dict(end)
        if phase.params is not None:
            cats["parameters"] = phase.params
        if phase.grads is not None:
            cats["gradients"] = phase.grads
        moments.append(Moment(phase.name, finish(_add(cats, phase.extra), phase.host_extra, race), race))
    return moments


_TRACE_CACHE: dict[TraceSpec, TraceResult] = {}


def cached_trace(spec: TraceSpec) -> TraceResult:
    """Traces are pure functions of their spec; the recommender asks for the same ones often."""
    if spec not in _TRACE_CACHE:
        if len(_TRACE_CACHE) > 64:
            _TRACE_CACHE.clear()
        _TRACE_CACHE[spec] = trace_step(spec)
    return _TRACE_CACHE[spec]


def estimate(
    cfg: RunConfig,
    world_size: int,
    *,
    target: str = "cuda",
    vocab_size: int | None = None,
    strategy: Strategy | None = None,
    routing: str = "worst",
    layers: int | None = None,
) -> Estimate:
    """Predict one step's per-rank peak for ``cfg`` on ``world_size`` ranks of ``target`` ("cuda" or "cpu");
    ``routing``: the case of a mixture of experts' routing the estimate is for (`harness.planner.moe.ROUTINGS`);
    ``layers``: the model's first decoder blocks only (the small twin `harness.train --check` runs)."""
    if world_size < 1:
        raise PlanError(f"world size must be >= 1, got {world_size}")
    if routing not in ROUTINGS:
        raise PlanError(f"routing '{routing}': choose one of {', '.join(ROUTINGS)}")
    try:
        strategy = strategy or load_strategy(cfg.strategy)
        check_run(cfg, strategy, world_size, has_accelerator=target == "cuda")  # the trainer's own gate
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    vocab = vocab_size or resolve_vocab(cfg)
    shape = build_fake_model(cfg.model.name, vocab, FakeTensorMode()).config.to_dict()  # the hidden size sizes DeepSpeed's "auto" buckets
    hidden = int(shape.get("hidden_size") or 0)
    try:
        check_modelled(cfg.lora, strategy, world_size)
        check_sequence_heads(cfg.parallel, shape)  # pre-flight's, where the model's shape is known
        plan = plan_for(cfg, strategy, world_size, hidden)
        tspec, espec = specs_for(cfg, strategy, world_size, hidden, target, vocab, plan)
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    tspec = replace(tspec, layers=layers)
    splits_experts = tspec.expert > 1
    if splits_experts:
        tspec = replace(tspec, routing=routing)  # each routing case its own trace: this rank computes what it is sent
    trace = cached_trace(tspec)
    info: ParamInfo = trace.params
    peak, moments, em, rank = _peak_rank(trace, espec, cfg.lora, target)
    peaks: tuple[tuple[str, int], ...] = ()
    if splits_experts and trace.moe is not None:
        other = next(case for case in ROUTINGS if case != routing)
        peaks = ((routing, peak.total), (other, _peak_rank(cached_trace(replace(tspec, routing=other)), espec, cfg.lora, target)[0].total))
    load_device, load_host = load_phase_bytes(espec, info)
    if cfg.lora.enabled and cfg.lora.quantize != "none":
        # bitsandbytes quantizes on load, a tensor at a time onto the device: the quantized base and one bf16 tensor
        load_device, load_host = (em.params_held or 0) + 2 * info.whole_largest, 4 * info.whole_largest
    race = peak.total - max(m.total - m.race for m in moments)  # the peak without any gloo-held buffer
    notes = list(em.notes)
    if race:
        notes.append(
            f"includes {race:,} B of one collective buffer gloo's worker thread may still hold "
            f"(a run peaks between {peak.total - race:,} and {peak.total:,} B)"
        )
    host = dict(em.host)
    if trace.offloaded_bytes:
        host["checkpoint_inputs"] = trace.offloaded_bytes  # pinned blocks (rounded up), all of them at the end of forward
    host_extra = max((p.host_extra for p in em.phases), default=0)
    host_total = sum(host.values())
    return Estimate(
        engine=em.name,
        world_size=world_size,
        rank=rank,
        peak=peak,
        moments=moments,
        host=host,
        host_peak=host_total + host_extra if host_total else 0,
        load_device=load_device,
        load_host=load_host,
        target=target,
        trace_seconds=trace.trace_seconds,
        notes=notes,
        params_total=info.total,
        largest_param=info.largest,
        race_bytes=race,
        config=plan.config,
        # the tokens of one micro-batch this rank's model sees (its slice of each sequence under sequence parallelism)
        routing=Routing(trace.moe, tspec.micro_batch * (tspec.seq_len // tspec.sequence), routing, tspec.expert, peaks)
        if trace.moe
        else None,
        traffic=planned_traffic(trace, espec.kind, world_size, plan.config.grad_accum),
    )


def _peak_rank(trace: TraceResult, espec: EngineSpec, lora: LoraConfig, target: str) -> tuple[Moment, list[Moment], EngineModel, int]:
    """The engine laid over the trace on the rank that peaks highest: its peak, moments, model and rank."""
    info = trace.params
    best: tuple[Moment, list[Moment], EngineModel, int] | None = None
    for rank in _worst_ranks(espec, info):
        em = engine_model(espec, info, rank)
        if lora.enabled and lora.quantize != "none":
            # the rest of the base (embeddings, head, norms) is held in the frozen dtype
            shard = espec.world if espec.kind == "fsdp" else 1
            em = quantized_base(em, info, lora.quantize, shard, espec.frozen_param_bytes, espec.torch_param_bytes)
        moments = walk(trace, em, cpu_run=target == "cpu")
        peak = max(moments, key=lambda m: m.total)
        if best is None or peak.total > best[0].total:
            best = (peak, moments, em, rank)
    assert best is not None
    return best


def _worst_ranks(espec: EngineSpec, info: ParamInfo) -> list[int]:
    """Only ZeRO-1/2 ranks differ (their gradient partitions); the others are all alike."""
    if espec.kind == "deepspeed" and espec.stage in (1, 2):
        sizes = [zero12_partition(info.numels, espec.world, r)[2] for r in range(espec.world)]
        return [max(range(espec.world), key=sizes.__getitem__)]
    return [0]


__all__ = ["Estimate", "Moment", "REPORT_CATS", "collective_race_bytes", "estimate", "plan_for", "resolve_vocab", "specs_for", "walk"]
