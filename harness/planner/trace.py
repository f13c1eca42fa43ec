"""Trace one training step's forward + backward without allocating a byte of model memory.

The model is built from its config under ``FakeTensorMode`` on device "cpu" (fake tensors
have shapes, dtypes and storages sizes but no data), wrapped exactly as the trainer wraps
it (activation checkpointing from ``harness.memory.activation_checkpoint``, FSDP2's real
``fully_shard`` through ``harness.engine.parallelize`` over a *fake* process group of the
requested world size) and run through the trainer's own loss (``harness.training.loss``).
torch's ``MemTracker`` / ``FSDPMemTracker`` follow every storage the step creates and
frees, so what comes out is the same byte count a real CPU run produces (measured:
notes/planner_accuracy.md), at a fraction of the cost: a Llama-3-8B-shaped step takes seconds.
A mixture of experts runs its grouped GEMM with the output the trainer's kernels allocate, in
any precision (``harness.planner.moe``; torch's own fake kernel asserts bf16).

Why only forward + backward: under fake DTensor parameters the optimizer step's transient
state comes out an order of magnitude too large, so the step is added analytically by
``harness.planner.model_states``. Why a *timeline* and not only the peak: for engines we
do not wrap in the trace (DDP, DeepSpeed) the trace runs the plain module, and the engine's
gradient and parameter handling is laid over the recorded per-op timeline afterwards.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from harness.config import LoraConfig, MemoryConfig, ParallelLayout, Strategy
from harness.distributed import CollectiveBytes, local_tensor
from harness.engine import ExpertGradients, fsdp_wrap, split_for
from harness.errors import ConfigError
from harness.memory import ActivationOffload, prepare_model
from harness.models import (
    PRESETS,
    empty_lora_model,
    hold_frozen_in,
    is_preset,
    model_config,
    twin_config,
    use_ulysses,
)
from harness.planner.moe import GroupedMMAsRun, MoeFacts, PlannedExchange, exchange_sizes, moe_facts, untraceable
from harness.planner.packed import pack_block_linears
from harness.planner.params import ParamInfo, param_info
from harness.planner.timeline import CAT_INDEX, CATS, tracker_class
from harness.training import DTYPES, RouterLoss, loss_for, precision_policy


class PlanError(ValueError):
    """A planning problem the user can fix; its message is one line."""


@dataclass(frozen=True)
class TraceSpec:
    """Everything about a step that changes what forward + backward allocate."""

    model_name: str
    vocab_size: int | None
    world_size: int
    micro_batch: int
    seq_len: int
    precision: str  # fp32 | bf16 | fp16
    wrap: str  # "fsdp": real fully_shard; "plain": the bare module (DDP / DeepSpeed / single)
    module_dtype: str  # dtype the module's parameters hold during forward (plain wrap)
    reshard_after_forward: bool = True
    fsdp_reduce_dtype: str = "fp32"
    ac_mode: str = "none"
    ac_every: int = 2
    loss_chunk_size: int = 0
    mlp_tiles: tuple[int, int] = (0, 0)  # tiled MLP: (tile count, tile tokens), one of them set; (0, 0) untiled
    offload_checkpoint_inputs: bool = False  # checkpointed blocks' inputs on the host (the offload's own hooks, simulated)
    micro_batches: int = 1  # traced micro-batches: 2 when gradient accumulation keeps grads across them
    autocast: bool = False  # fp16 torch engines run under autocast with fp32 weights
    # (r, alpha, dropout, target modules, target parameters): peft adapters, base frozen
    lora: tuple[int, float, float, tuple[str, ...] | None, tuple[str, ...] | None] | None = None
    nf4_storage: str | None = None  # QLoRA: the block linears' NF4 codes packed in this dtype (harness.planner.packed)
    frozen_dtype: str | None = None  # LoRA: the frozen base held in this dtype, not module_dtype (PrecisionPolicy.frozen_dtype)
    sequence: int = 1  # Ulysses: each sample's sequence split over this many ranks; the trace is one rank's slice
    packed: bool = False  # rows pack several instruction examples: attention gets the (B, 1, S, S) mask that keeps them apart
    expert: int = 1  # expert parallelism: each MoE layer's experts split over this many ranks; the trace is rank 0's
    routing: str = "worst"  # under expert parallelism, the routing case traced (harness.planner.moe.ROUTINGS)
    layers: int | None = None  # the model's first `layers` decoder blocks only (`--check`'s twin); None: all of them
    aux_loss_coef: float | None = None  # `moe.aux_loss_coef` read (None: auto): the router's loss, as the trainer adds it

    def memory(self) -> MemoryConfig:
        """The memory section whose techniques the traced model is prepared with (compile is not traced)."""
        tiles, tokens = self.mlp_tiles
        return MemoryConfig(activation_checkpointing=self.ac_mode, ac_every=self.ac_every, tiled_mlp=tiles, tiled_mlp_tokens=tokens)


def adapter_key(lora: LoraConfig) -> tuple[int, float, float, tuple[str, ...] | None, tuple[str, ...] | None]:
    """A run's adapters as `TraceSpec.lora` holds them (hashable: the spec keys a cache of traces)."""

    def names(value: list[str] | None) -> tuple[str, ...] | None:
        return tuple(value) if value is not None else None

    return lora.r, lora.alpha, lora.dropout, names(lora.target_modules), names(lora.target_parameters)


def adapter_config(key: tuple[int, float, float, tuple[str, ...] | None, tuple[str, ...] | None]) -> LoraConfig:
    """The `LoraConfig` an `adapter_key` was made from (what the trace builds its adapters by)."""
    r, alpha, dropout, modules, parameters = key

    def names(value: tuple[str, ...] | None) -> list[str] | None:
        return list(value) if value is not None else None

    return LoraConfig(enabled=True, r=r, alpha=alpha, dropout=dropout, target_modules=names(modules), target_parameters=names(parameters))


@dataclass
class TraceResult:
    """Per-op live bytes by category of one rank, and where the peak of the trace is."""

    spec: TraceSpec
    rows: list[tuple[int, ...]]  # per op: bytes per CATS entry
    phases: list[int]  # per op: 0 forward, 1 backward
    modules: list[int]  # per op: index into module_names
    module_names: list[str]
    params: ParamInfo
    gloo_extra: dict[int, int] = field(default_factory=dict)  # row -> bytes gloo adds inside that collective
    # Per row: bytes of the last collective's buffer once the step has freed it (gloo's worker may
    # still hold it there); and the same past the trace's last op.
    race: list[int] = field(default_factory=list)
    race_after_backward: int = 0
    trace_seconds: float = 0.0
    held_param_bytes: int = 0  # parameters held between steps (FSDP2: the shards; each row's excess is its gathered groups)
    # Per op (FSDP2 only; empty otherwise): the gradient bytes FSDP2 holds as its shards' `.grad`, i.e.
    # already reduce-scattered. The rest of a row's gradients are the unsharded ones of the groups in backward.
    sharded_grads: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    offloaded_bytes: int = 0  # pinned host bytes of the offloaded checkpoint inputs at most (per rank; harness.memory.pinned)
    moe: MoeFacts | None = None  # the model's experts (harness.planner.moe); None: a dense model
    # The collectives the traced forwards and backwards dispatch (FSDP2's gathers and reduce-scatters,
    # the experts' and Ulysses' all-to-alls): bytes this rank sends by kind (harness.distributed.traffic),
    # per traced micro-batch (the second stands for every one after it)
    sent: list[dict[str, int]] = field(default_factory=list)
    grad_bytes: int = 0  # this rank's trained parameters' bytes (a gradient each, in their dtype)
    split_grad_bytes: int = 0  # of which the experts split over ranks (reduced over their replicas, not the world)
    buffer_bytes: int = 0  # the model's buffers (DDP broadcasts them from rank 0 before every forward)

    def total(self, i: int) -> int:
        return sum(self.rows[i])

    def peak_index(self) -> int:
        return max(range(len(self.rows)), key=self.total) if self.rows else 0

    def peak(self) -> int:
        return self.total(self.peak_index()) if self.rows else 0

    def moment(self, i: int) -> str:
        phase = "backward" if self.phases[i] else "forward"
        where = self.module_names[self.modules[i]]
        return f"{phase}, in {where}" if where else f"{phase}, outside the model's modules (the loss)"

    def category(self, cat: str) -> list[int]:
        j = CAT_INDEX[cat]
        return [r[j] for r in self.rows]


# ----------------------------------------------------------------------------- fake world


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks that moves no data (we are rank 0)."""
    if dist.is_initialized():
        raise PlanError("a real process group is already running in this process; plan before launching, not inside training")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def real_run_masking(packed: bool = False) -> Iterator[None]:
    """Make HF's attention-mask logic decide as it does on the trainer's real inputs.

    HF treats fake tensors as "tracing" and then refuses to prove that the position ids
    (``arange``, generated inside the model) hold no packed sequences, so it builds a 4-D
    mask, which also turns off grouped-query SDPA and makes every layer copy K/V per head.
    A real run of the trainer on text (contiguous blocks, no padding mask, no position ids)
    proves it and runs mask-free. Without this the trace over-counts attention activations.
    ``packed``: the rows pack several examples, the real run finds them and builds that mask
    (its (B, 1, S, S) booleans and what attention does with them): HF's own decision is kept.
    """
    if packed:
        yield
        return
    try:
        from transformers import masking_utils
    except ImportError:  # older transformers: nothing to align
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def build_fake_model(
    model_name: str,
    vocab_size: int | None,
    fake_mode: Any,
    dtype: torch.dtype = torch.float32,
    lora: LoraConfig | None = None,
    layers: int | None = None,
) -> nn.Module:
    """The model with fake storage: the config is read (a preset or a local dir), weights never are.

    Built directly in ``dtype`` (fake parameters cannot be converted in place by ``.to``),
    with floating buffers cast as ``model.to(dtype)`` in the trainer casts them. ``lora``:
    peft's adapters injected into it, base frozen, every parameter in ``dtype`` - the module
    the trainer builds (``harness.models.empty_lora_model``, then ``.to(dtype)``), so a LoRA
    step's activations are its own (a frozen linear saves no input for a weight gradient).
    ``layers``: its first decoder blocks only, as ``harness.models.twin_config`` cuts them.
    """
    from transformers import AutoModelForCausalLM

    if not is_preset(model_name) and not os.path.isdir(model_name) and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise PlanError(
            f"cannot build model '{model_name}': not a preset ({', '.join(PRESETS)}) nor a local model "
            "directory (hub ids need the config cached, and HF_HUB_OFFLINE=1)"
        )
    try:
        config = model_config(model_name, vocab_size=vocab_size)
    except Exception as exc:
        raise PlanError(
            (f"cannot build model '{model_name}': {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}").rstrip(": ")
        ) from None
    if vocab_size and getattr(config, "vocab_size", vocab_size) != vocab_size:
        config.vocab_size = vocab_size  # an explicit --vocab-size wins over a local model's config
    if layers is not None:
        config = twin_config(config, layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with fake_mode:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            if lora is not None:  # adapters made on the meta device, as the trainer makes them, then given fake storage
                model = empty_lora_model(model, lora, quiet=True)
            with fake_mode:
                for module in model.modules():
                    for name, buf in list(module._buffers.items()):
                        if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                            module._buffers[name] = buf.to(dtype)
                    for name, p in list(module._parameters.items()):
                        if p is not None and (p.device.type == "meta" or (p.is_floating_point() and p.dtype != dtype)):
                            module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=p.requires_grad)
        except ConfigError as exc:  # the adapters' own refusal (harness.models.resolve_targets), as pre-flight says it
            raise PlanError(f"model '{model_name}': {exc}") from None
        except Exception as exc:
            raise PlanError(f"cannot build model '{model_name}' from its config: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    return model


def _split_experts(model: nn.Module, spec: TraceSpec, moe: MoeFacts, layout: ParallelLayout) -> tuple[ExpertGradients, PlannedExchange]:
    """Rank 0's experts, split as the trainer splits them (`harness.engine.split_for`, over the fake
    group's `layout`): their keeper, and the exchange's split sizes for the traced routing case (each
    rank routes its slice of every sequence)."""
    experts = split_for(model, layout, "cpu")
    tokens = spec.micro_batch * (spec.seq_len // spec.sequence)
    return experts, PlannedExchange(*exchange_sizes(spec.routing, tokens, moe.top_k, moe.experts, spec.expert))


# ----------------------------------------------------------------------------- the trace


def _wrap_fsdp(model: nn.Module, spec: TraceSpec, layout: ParallelLayout, experts: ExpertGradients | None) -> nn.Module:
    """The trainer's own FSDP2 wrapping (same groups, same mixed precision) over the fake group;
    `experts`: the experts split over ranks, each range sharded over its replicas as the trainer does."""

    strategy = Strategy(
        "fsdp",
        "plan",
        "plan",
        zero_stage=3 if spec.reshard_after_forward else 2,
        reshard_after_forward=spec.reshard_after_forward,
        reduce_dtype=spec.fsdp_reduce_dtype,
    )
    policy = precision_policy(spec.precision, torch.device("cpu"), "fsdp")
    return fsdp_wrap(model, strategy, policy, layout.shard_mesh("cpu"), experts)


def _step_input(spec: TraceSpec, vocab: int) -> torch.Tensor:
    """One micro-batch as this rank gets it: whole sequences (packed instruction data: `(B, 3, S)`
    blocks of (input_ids, labels, positions)), or under sequence parallelism its `(B, 3, L+1)` slice
    of them (`harness.data.SequenceSlice`)."""
    if spec.sequence > 1:
        return torch.randint(0, vocab, (spec.micro_batch, 3, spec.seq_len // spec.sequence + 1))
    if spec.packed:
        return torch.randint(0, vocab, (spec.micro_batch, 3, spec.seq_len))
    return torch.randint(0, vocab, (spec.micro_batch, spec.seq_len))


def _loss(model: nn.Module, batch: torch.Tensor, spec: TraceSpec, router: RouterLoss) -> torch.Tensor:
    """The trainer's loss for this input (unpacked instruction rows cost what text does), with a
    mixture-of-experts router's loss as the trainer adds it (its logits kept for the backward, and
    under sequence parallelism gathered over the sequence group)."""
    return loss_for(spec.sequence > 1, spec.packed)(model, batch, chunk_size=spec.loss_chunk_size, router=router)


def trace_step(spec: TraceSpec) -> TraceResult:
    """Trace forward + backward of ``spec.micro_batches`` micro-batches on rank 0 of a fake world."""
    if spec.world_size < 1:
        raise PlanError(f"world size must be >= 1, got {spec.world_size}")
    start = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    dtype = DTYPES[spec.module_dtype]  # FSDP2: fp32 sharded masters, or bf16 shards under bf16_pure
    lora = adapter_config(spec.lora) if spec.lora is not None else None
    if lora is not None and spec.nf4_storage is not None:  # QLoRA: what it cannot quantize is refused, as in the trainer
        lora = replace(lora, quantize="nf4")
    model = build_fake_model(spec.model_name, spec.vocab_size, fake_mode, dtype, lora, spec.layers)
    info = param_info(model)  # the base's shapes as they are in the checkpoint (the formulas' input)
    if spec.frozen_dtype is not None:
        with fake_mode:
            hold_frozen_in(model, DTYPES[spec.frozen_dtype])
    if spec.nf4_storage is not None:
        with fake_mode:
            pack_block_linears(model, DTYPES[spec.nf4_storage])
    vocab = int(model.config.vocab_size)
    moe = moe_facts(model)
    refused = untraceable(moe, spec.model_name)
    if refused:
        raise PlanError(refused)
    # the grouped GEMM's output as the trainer's CPU and CUDA kernels make it, in any precision (torch's fake asserts bf16)
    grouped = GroupedMMAsRun() if moe is not None else contextlib.nullcontext()
    Timeline = tracker_class()
    # plain wrap: the engine is laid over afterwards, but Ulysses' and the experts' exchanges need their groups
    world = spec.world_size if spec.wrap == "fsdp" else math.lcm(spec.sequence, spec.expert)
    layout = ParallelLayout(world, spec.sequence, spec.expert)
    exchange: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    try:
        with fake_process_group(world):
            if spec.sequence > 1:  # as the trainer: attention swapped before AC, tiling and sharding
                use_ulysses(model, layout.sequence_group("cpu"), spec.packed)
            experts: ExpertGradients | None = None
            if spec.expert > 1 and moe is not None:  # as the trainer: experts split on the model before it is prepared
                experts, exchange = _split_experts(model, spec, moe, layout)
                info = replace(param_info(model), split_names=frozenset(experts.names))
            prepare_model(model, spec.memory())  # the engines' own preparation, in its order
            if spec.wrap == "fsdp":
                model = _wrap_fsdp(model, spec, layout, experts.bind(model) if experts is not None else None)
            router = RouterLoss(spec.aux_loss_coef)  # the trainer's: attached to the prepared model, over its sequence group
            router.attach(model, layout.sequence_group("cpu") if spec.sequence > 1 else None)
            split_ids = {id(p) for p in experts.bind(model).params} if experts is not None else set()
            held = sum(local_tensor(p).untyped_storage().nbytes() for p in model.parameters())
            tracker: Any = Timeline()
            tracker.track_external(model)
            trained = [p for p in model.parameters() if p.requires_grad]  # FSDP2's shards, registered between steps
            grad_bytes = sum(local_tensor(p).numel() * p.element_size() for p in trained)
            split_grad_bytes = sum(local_tensor(p).numel() * p.element_size() for p in trained if id(p) in split_ids)
            buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
            traffic = CollectiveBytes()
            hooks = tracker.follow_sharded_grads(trained) if spec.wrap == "fsdp" else []
            with fake_mode:
                ids = [_step_input(spec, vocab) for _ in range(spec.micro_batches)]
                tracker.track_external(*ids)
                autocast = torch.autocast("cpu", dtype=DTYPES[spec.precision]) if spec.autocast else contextlib.nullcontext()
                # the trainer's own offload, simulated: the device copy is released at pack time and an empty one
                # comes back when backward (or the prefetch ahead of it) asks for it
                offload = ActivationOffload(scope="checkpoint_inputs", model=model, simulate=True, pin_memory=True)
                with warnings.catch_warnings(), real_run_masking(packed=spec.packed), grouped, exchange, traffic, tracker:
                    warnings.simplefilter("ignore")
                    sent: list[dict[str, int]] = []
                    for micro, batch in enumerate(ids):
                        before = dict(traffic.sent)
                        # FSDP2 reduce-scatters every micro-batch, as the engine does (`FSDPEngine`)
                        if micro:
                            tracker.reset_mod_stats()
                        with autocast, offload if spec.offload_checkpoint_inputs else contextlib.nullcontext():
                            loss = _loss(model, batch, spec, router)
                        (loss / max(1, spec.micro_batches)).backward()
                        sent.append({k: v - before.get(k, 0) for k, v in traffic.sent.items() if v - before.get(k, 0)})
                        del loss
            for hook in hooks:
                hook.remove()
    except PlanError:
        raise
    except Exception as exc:  # the model's own code, or a wrapper it does not support: bad input, not a planner crash
        valued = isinstance(exc, (DynamicOutputShapeException, DataDependentOutputException))  # e.g. experts looped over by routing
        raise PlanError(
            f"cannot trace a training step of model '{spec.model_name}' ({spec.wrap}, AC {spec.ac_mode}): "
            + ("its code takes a shape or a branch from tensor values, which a fake-tensor trace has none of: " if valued else "")
            + f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        ) from None
    result = TraceResult(
        spec,
        tracker.rows,
        tracker.phases,
        tracker.modules,
        tracker.module_names,
        info,
        tracker.gloo_extra,
        tracker.race,
        tracker.race_after_backward,
        held_param_bytes=held,
        sharded_grads=tracker.sharded_grads,
        offloaded_bytes=offload.stats.peak_pinned_bytes,
        moe=moe,
        sent=sent,
        grad_bytes=grad_bytes,
        split_grad_bytes=split_grad_bytes,
        buffer_bytes=buffer_bytes,
    )
    result.trace_seconds = time.perf_counter() - start
    return result


__all__ = [
    "CATS",
    "ParamInfo",
    "PlanError",
    "TraceResult",
    "TraceSpec",
    "build_fake_model",
    "fake_process_group",
    "param_info",
    "trace_step",
]
