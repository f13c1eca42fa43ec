"""Model-state memory per rank for every engine: what the trace does not run, in formulas.

The trace (``harness.planner.trace``) runs forward + backward. What it cannot see is
written down here, each term named after the buffer of the engine that allocates it:

- torch single process / DDP (``gradient_as_bucket_view=True``: the gradients *are* the
  DDP buckets, allocated once at wrap time) and FSDP2 (sharded fp32 parameters, traced);
- DeepSpeed ZeRO-1/2: a flat bit16 parameter buffer padded to ``2 * world``, an fp32
  master partition, the ``reduce_bucket_size`` gradient bucket, the gradient partition
  (every parameter that touches this rank's slice, whole), and at the step an fp32 copy
  of the gradient partition; with CPU offload the master, gradients and optimizer move to
  the host plus two largest-parameter staging buffers;
- pinned host buffers (FSDP2's CPU offload on a GPU; a DeepSpeed offload block's `pin_memory`)
  as torch's caching host allocator holds them: each rounded up to a power of two
  (``harness.memory.pinned``), the optimizer's state (pageable) as it is;
- DeepSpeed ZeRO-3: per-parameter partitions padded to ``world``, persistent small
  parameters kept whole, a gradient-partition buffer and a reduce bucket allocated at
  init, gathered parameters up to ``stage3_max_live_parameters``, and per optimizer
  sub-group an fp32 gradient copy at the step;
- the optimizer (``harness.planner.optimizer_model``): per tensor,
  ``harness.training.optimizer_state_bytes`` (the one account of what each optimizer keeps:
  Adam/AdamW two states in the dtype of what they step, the parameter for torch, fp32 master
  partitions for DeepSpeed; torchao's bf16/8-bit/4-bit moments with their block scales and
  code books; bitsandbytes' 8-bit moments, absmax and shared code books), of each rank's local
  numel (FSDP2: its shard of each tensor); the step's transient memory is what the step
  allocates for the largest tensor stepped (none for the torch engines' fused Adam/AdamW;
  DeepSpeed's single-tensor loop: ``sqrt`` and the division; torchao's and bitsandbytes' fp32
  copies); bitsandbytes' paged states on a GPU are the host's.

Each engine is described by an :class:`EngineModel`; ``harness.planner.estimate`` lays it
over the traced timeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from harness.memory import pinned_block, pinned_bytes
from harness.planner.fsdp_offload import in_flight_bytes, largest_group_shard
from harness.planner.optimizer_model import (
    EngineSpec,
    paged_host,
    paged_notes,
    step_bytes_per_element,
    step_scalar_bytes,
    step_transient_multiple,
    torch_optimizer_bytes,
    torch_step_transient,
)
from harness.planner.params import ParamInfo
from harness.training import DTYPE_BYTES


@dataclass
class Phase:
    """An analytic moment after backward: what replaces or extends the end-of-backward state."""

    name: str
    params: int | None = None  # parameters held (None: as at the end of backward)
    grads: int | None = None  # gradients held (None: as at the end of backward)
    extra: dict[str, int] = field(default_factory=dict)  # device bytes added, by category
    host_extra: int = 0  # host bytes added (an offloaded optimizer step)


@dataclass
class EngineModel:
    """How one rank's engine holds model state, laid over a traced forward/backward timeline.

    ``params``/``grads`` replace what the plain trace holds (the bare module's parameters
    and autograd's accumulated ``.grad``) by what the engine holds; ``None`` keeps the
    traced bytes (FSDP2 is traced through its real wrapper, single process is the bare
    module). ``bucket`` is a communication buffer that appears with the first gradient of
    backward and is released at its end.
    """

    name: str
    params: int | None  # parameter bytes held in forward/backward
    grads: int | None  # gradient bytes held in backward (None: the traced ones)
    grads_from_start: bool  # the gradient buffers exist before backward (DDP buckets)
    bucket: int  # communication bytes from the first gradient to the end of backward
    resident: dict[str, int]  # device bytes held all step long that the trace does not hold
    end_params: int | None  # parameters held once backward has finished (ZeRO-3 releases the gathered ones)
    end_grads: int | None  # gradients held once backward has finished
    phases: list[Phase]
    host: dict[str, int]  # host (CPU) bytes held all step long (offload)
    optimizer_in_backward: bool = False  # each gradient is stepped by its hook as it appears, then freed
    oib_step_cap: int = 0  # optimizer in backward: the largest step's temporaries
    oib_step_per_grad_byte: float = 2.0  # a hook's step temporaries per byte of the gradient it steps
    notes: list[str] = field(default_factory=list)
    # Parameter bytes held between steps in place of the trace's own (`TraceResult.held_param_bytes`),
    # keeping what a traced row holds beyond them: the groups FSDP2 has gathered (unsharded) at that op.
    # For a held state the trace cannot build (a QLoRA base) or one moved off the device (CPU offload).
    params_held: int | None = None
    # FSDP2 CPU offload: each reduce-scattered gradient shard goes to the host, so a traced row's device
    # gradients are its unsharded ones (the groups in backward, not reduced yet): `TraceResult.sharded_grads` off.
    sharded_grads_on_host: bool = False
    # Of `grads`, the bytes outside the buffers that exist from the start (DDP's buckets leave out the experts
    # split over ranks): autograd makes them in backward, as the trace's own gradients grow.
    grads_made_in_backward: int = 0
    # DDP under gradient accumulation: the micro-batches before the last run in `no_sync`, so autograd
    # accumulates its own .grad tensors beside the buckets; the last backward copies each into its bucket
    # and frees it as it is reduced (booked until the end of backward: at most the traced gradients more).
    accumulates_beside_buckets: bool = False


# ------------------------------------------------------------------------------- helpers


def adam_states(optimizer: str) -> int:
    """fp32 states per element of DeepSpeed's own optimizers (the only ones it runs)."""
    return 2 if optimizer in ("adam", "adamw") else 0


def cpu_adam(spec: EngineSpec) -> bool:
    """DeepSpeedCPUAdam steps the offloaded optimizer in place: the engine plan says where (on a GPU
    machine by default; on any where the file forces it); a bare spec decides by its target."""
    if spec.cpu_adam is not None:
        return spec.cpu_adam
    return spec.target == "cuda" and spec.optimizer in ("adam", "adamw")


def fsdp_local_numel(shape: tuple[int, ...], world: int, rank: int = 0) -> int:
    """FSDP2 shards dim 0 in chunks of ceil(dim0 / world); padding goes to the last ranks."""
    if not shape:
        return 1 if rank == 0 else 0
    chunk = math.ceil(shape[0] / world)
    rows = max(0, min(chunk, shape[0] - rank * chunk))
    return rows * math.prod(shape[1:])


def zero12_partition(numels: list[int], world: int, rank: int) -> tuple[int, int, int]:
    """(flat numel, partition numel, gradient-partition numel) of ZeRO-1/2 on ``rank``.

    The flat buffer is padded to a multiple of ``2 * world`` (DeepSpeed's NCCL start
    alignment); the gradient partition holds every parameter that starts inside, or
    straddles the start of, this rank's slice - whole.
    """
    total = sum(numels)
    align = 2 * world
    flat = math.ceil(total / align) * align
    part = flat // world
    start, end = part * rank, part * (rank + 1)
    in_partition, index = 0, 0
    for n in numels:
        if start <= index < end or index < start < index + n:
            in_partition += n
        index += n
    return flat, part, in_partition


def zero3_partitions(numels: list[int], world: int, threshold: int) -> tuple[int, int, int]:
    """(partition numel, persistent numel, non-persistent numel) of ZeRO-3 (per-param padding to ``world``)."""
    part = sum(math.ceil(n / world) for n in numels)
    persistent = sum(n for n in numels if n <= threshold)
    return part, persistent, sum(numels) - persistent


def zero3_subgroups(numels: list[int], world: int, sub_group_size: int) -> list[int]:
    """Partition numel of each optimizer sub-group (DeepSpeed closes a group once it reaches the size)."""
    parts = [math.ceil(n / world) for n in numels]
    if sub_group_size >= sum(parts):
        return [sum(parts)]
    groups, current = [], 0
    for i, p in enumerate(parts):
        current += p
        if current >= sub_group_size or i == len(parts) - 1:
            groups.append(current)
            current = 0
    return groups


# ------------------------------------------------------------------------------- engines


def _in_backward(plain: EngineModel, step_cap: int, per_grad_byte: float, note: str) -> EngineModel:
    """``plain`` with the optimizer stepped in backward: each gradient is stepped by its own hook as
    it appears, then freed, so none is held once backward ends and there is no step phase."""
    return replace(
        plain,
        end_grads=0,
        phases=[],
        optimizer_in_backward=True,
        oib_step_cap=step_cap,
        oib_step_per_grad_byte=per_grad_byte,
        notes=[note, *plain.notes],
    )


def torch_model(spec: EngineSpec, info: ParamInfo) -> EngineModel:
    """Single process and DDP: full parameters and gradients on every rank, a torch optimizer."""
    pb = spec.torch_param_bytes
    total = info.total * pb
    opt = {"optimizer_state": torch_optimizer_bytes(spec, info.numels)}
    host = paged_host(spec, info.numels)
    transient = torch_step_transient(spec, info.largest)
    ddp = spec.kind == "ddp" and spec.world > 1
    name = "ddp" if ddp else "single"
    notes = paged_notes(spec, info.numels, info.largest)
    step = [Phase("optimizer step", extra={"optimizer_state": transient})]
    plain = EngineModel(name, None, None, False, 0, opt, None, None, step, host, notes=notes)
    if spec.optimizer_in_backward:  # single process only
        note = "optimizer in backward: each parameter steps (and frees its gradient) as the gradient appears"
        return _in_backward(plain, transient, step_bytes_per_element(spec) / pb, note)
    if ddp:
        # gradient_as_bucket_view=True: the DDP buckets are the .grad tensors, allocated at wrap time; the
        # experts split over ranks are left out of them, their gradients made by autograd in backward.
        unbucketed = info.split_expert_numel * pb
        return EngineModel(
            name,
            None,
            total,
            True,
            0,
            opt,
            None,
            total,
            step,
            host,
            notes=notes,
            grads_made_in_backward=unbucketed,
            accumulates_beside_buckets=True,
        )
    return plain


def fsdp_model(spec: EngineSpec, info: ParamInfo) -> EngineModel:
    """FSDP2: sharded fp32 parameters and gradients are traced; the optimizer is added here. The
    experts split over ranks (expert parallelism): each rank's range sharded over its replicas
    (`harness.engine.parallelize.fsdp_wrap`)."""
    replicas = spec.world // spec.expert
    local = [fsdp_local_numel(s, replicas if n in info.split_names else spec.world, 0) for n, s in zip(info.names, info.shapes)]
    states = torch_optimizer_bytes(spec, local)
    transient = torch_step_transient(spec, max(local, default=0))
    if spec.offload_params != "none" and spec.target == "cuda":
        # CPUOffloadPolicy (harness.planner.fsdp_offload): every shard and the step on the host; the
        # device holds the gathered groups (traced) and the shards being copied in for their gathers.
        # (On a CPU run the host is the device: the policy moves nothing, planned as FSDP2 below.)
        # The gathered (unsharded) parameters of the groups running stay traced: they are on the device,
        # as are the unsharded gradients of a group's backward until its reduce-scatter (only the reduced
        # shards leave: `sharded_grads_on_host`).
        frozen = [fsdp_local_numel(s, spec.world, 0) for s in info.frozen_shapes]
        pb, fb = spec.torch_param_bytes, spec.frozen_param_bytes
        group = largest_group_shard(
            [*((n, k * pb) for n, k in zip(info.names, local)), *((n, k * fb) for n, k in zip(info.frozen_names, frozen))]
        )
        return EngineModel(
            "fsdp+offload",
            None,
            None,
            False,
            0,
            {"communication": in_flight_bytes(group)},
            0,
            0,
            [Phase("optimizer step (host)", host_extra=transient)],
            {  # pinned per parameter: each padded shard, each reduce-scattered gradient copied to the host
                "optimizer_state": states,
                "parameters": pinned_bytes([*(k * pb for k in local), *(k * fb for k in frozen)]),
                "gradients": pinned_bytes(k * pb for k in local),
            },
            notes=[
                f"FSDP2 CPU offload: every shard on the host; on the device the gathered groups and "
                f"{in_flight_bytes(group):,} B of shards copied in for their gathers; the unsharded gradients of "
                f"the groups in backward until their reduce-scatter"
            ],
            params_held=0,
            sharded_grads_on_host=True,
        )
    step = [Phase("optimizer step", extra={"optimizer_state": transient})]
    plain = EngineModel("fsdp", None, None, False, 0, {"optimizer_state": states}, None, None, step, {})
    if spec.optimizer_in_backward:
        note = "optimizer in backward: each sharded gradient steps (and is freed) after its group's reduce-scatter"
        return _in_backward(plain, transient, step_bytes_per_element(spec) / spec.torch_param_bytes, note)
    return plain


def zero12_model(spec: EngineSpec, info: ParamInfo, rank: int) -> EngineModel:
    """DeepSpeed ZeRO-1/2 (stage_1_and_2.py), optionally with the optimizer offloaded."""
    b = DTYPE_BYTES[spec.precision]
    flat, part, grad_part = zero12_partition(info.numels, spec.world, rank)
    params = flat * b
    master = part * 4
    states = adam_states(spec.optimizer) * part * 4 + step_scalar_bytes(spec, 1)
    transient = step_transient_multiple(spec.optimizer, spec.weight_decay, fused=False) * part * 4
    bucket = spec.reduce_bucket * b if spec.contiguous_gradients else 0
    gip = grad_part * b
    name = f"zero{spec.stage}"
    notes = [f"reduce bucket {spec.reduce_bucket:,} elements ({bucket:,} bytes) from the first gradient"]
    norm64 = 8 * min(info.largest, part)  # gradient norms are taken in fp64: a copy of one gradient slice
    if spec.offload_optimizer != "none":
        pin = pinned_block if spec.pin_optimizer and spec.target == "cuda" else int  # int: pageable (or a CPU run: nothing pins)
        host = {
            "parameters": pin(master) + pin(part * b),  # fp32 master + the bit16 staging copy of the update
            "gradients": pin(part * 4) + pin(info.largest * b),  # fp32 gradient partition + a staging buffer
            "optimizer_state": states,
        }
        step = Phase("optimizer step (host)", grads=0, host_extra=0 if cpu_adam(spec) else transient)
        # Each gradient is normed (fp64) and copied to the host inside the backward epilogue, bucket still held.
        norm = Phase(
            "gradient norm in fp64 (backward epilogue)", grads=info.largest * b, extra={"communication": bucket, "temporaries": norm64}
        )
        return EngineModel(
            f"{name}+offload",
            params,
            0,
            False,
            bucket,
            {"communication": info.largest * b},
            params,
            0,
            [norm, step],
            host,
            notes=notes + ["optimizer offloaded: gradients stream to an fp32 host partition"],
        )
    resident = {"optimizer_state": master + states}
    # The last gradient reduced may still be alive while the norm runs (seen in 1 of 4 CPU runs:
    # the asynchronous reduce had not yet dropped it); a planner counts the race.
    norm = Phase("gradient norm in fp64", grads=gip + info.largest * b, extra={"temporaries": norm64})
    step = Phase("optimizer step", grads=part * 4, extra={"optimizer_state": transient})
    if spec.stage == 1:
        # Gradients stay whole in .grad until the boundary; the epilogue reduces them into the partition.
        epilogue = Phase("gradient reduction (end of backward)", extra={"gradients": gip, "communication": bucket})
        return EngineModel(name, params, None, False, bucket, resident, params, None, [epilogue, norm, step], {}, notes=notes)
    return EngineModel(name, params, gip, False, bucket, resident, params, gip, [norm, step], {}, notes=notes)


def zero3_model(spec: EngineSpec, info: ParamInfo) -> EngineModel:
    """DeepSpeed ZeRO-3 (stage3.py), optionally offloading parameters and/or optimizer (CPU or NVMe)."""
    b = DTYPE_BYTES[spec.precision]
    part, persistent, nonpersistent = zero3_partitions(info.numels, spec.world, spec.persistence_threshold)
    largest_group = max(zero3_subgroups(info.numels, spec.world, spec.sub_group_size))
    groups = len(zero3_subgroups(info.numels, spec.world, spec.sub_group_size))
    gathered = min(nonpersistent, spec.max_live) * b
    if spec.world == 1 and (spec.offload_params == "none" or spec.target == "cpu"):
        gathered = 0  # one rank: DeepSpeed points param.data at the partition (_no_gather_coalesced), no copy
    states = adam_states(spec.optimizer) * part * 4 + step_scalar_bytes(spec, groups)
    transient = step_transient_multiple(spec.optimizer, spec.weight_decay, fused=False) * largest_group * 4
    bucket = spec.reduce_bucket * b if spec.contiguous_gradients else 0
    grad_buffer = part * b  # grad_partitions_flat_buffer (gradient-accumulation dtype)
    params_on_device = spec.offload_params == "none"
    held = persistent * b + (part * b if params_on_device else 0)
    resident: dict[str, int] = {"communication": bucket}
    host: dict[str, int] = {}
    if spec.offload_params == "cpu":
        # one flat buffer, pinned whatever the block's pin_memory says (on a GPU machine: a CPU run pins nothing)
        host["parameters"] = pinned_block(part * b) if spec.target == "cuda" else part * b
    elif spec.offload_params == "nvme":
        host["nvme_swap_buffers"] = spec.nvme_buffer_count * spec.nvme_buffer_size * b
    norm64 = 8 * math.ceil(info.largest / spec.world)  # fp64 copy of the largest gradient partition
    if spec.offload_optimizer == "none":
        resident["gradients"] = grad_buffer
        resident["optimizer_state"] = part * 4 + states
        step = Phase("optimizer step", params=held, grads=largest_group * 4, extra={"optimizer_state": transient})
    else:
        # accumulation buffer + fp32 gradient for the step (one buffer per optimizer sub-group)
        pin = pinned_block if spec.pin_optimizer and spec.target == "cuda" else int  # int: pageable (or a CPU run: nothing pins)
        sub_groups = zero3_subgroups(info.numels, spec.world, spec.sub_group_size)
        host["gradients"] = pin(grad_buffer) + sum(pin(g * 4) for g in sub_groups)
        if spec.offload_optimizer == "cpu":
            host["parameters"] = host.get("parameters", 0) + part * 4  # fp32 master
            host["optimizer_state"] = states
        else:  # nvme: master and states page through pinned buffers (one sub-group at a time, 4 buffers)
            host["nvme_swap_buffers"] = host.get("nvme_swap_buffers", 0) + 4 * largest_group * 4
        step = Phase("optimizer step (host)", params=held, grads=0, host_extra=0 if cpu_adam(spec) else transient)
    name = "zero3" + ("+offload" if spec.offload_optimizer != "none" or not params_on_device else "")
    norm = Phase("gradient norm in fp64", params=held, grads=0, extra={"temporaries": norm64})
    return EngineModel(
        name,
        held + gathered,
        0,
        False,
        0,
        resident,
        held,
        0,
        [norm, step],
        host,
        notes=[f"gathered parameters (up to stage3_max_live_parameters={spec.max_live:,}) held through forward and backward"],
    )


def engine_model(spec: EngineSpec, info: ParamInfo, rank: int = 0) -> EngineModel:
    if spec.kind in ("single", "ddp"):
        return torch_model(spec, info)
    if spec.kind == "fsdp":
        return fsdp_model(spec, info)
    if spec.kind == "deepspeed":
        if spec.stage in (1, 2):
            return zero12_model(spec, info, rank)
        if spec.stage == 3:
            return zero3_model(spec, info)
    raise ValueError(f"no model-state formulas for kind={spec.kind!r} stage={spec.stage}")


# ------------------------------------------------------------------------------- the per-dtype view


def dtype_breakdown(total_params: int, world: int = 1) -> list[dict[str, float | str]]:
    """Parameters / gradients / Adam state for fp32, bf16 with fp32 Adam, and bf16 with bf16 Adam.

    The per-dtype table (the quick "is this even close" view of the report), per rank when the
    model states are split evenly over ``world`` ranks; no activations, no overhead.
    """
    rows = []
    for label, pb, gb, ob in (("fp32", 4, 4, 8), ("bf16 (fp32 Adam state)", 2, 2, 8), ("bf16 + bf16 Adam state", 2, 2, 4)):
        p, g, o = total_params * pb / world, total_params * gb / world, total_params * ob / world
        rows.append({"mode": label, "parameters": p, "gradients": g, "optimizer_state": o, "total": p + g + o})
    return rows


__all__ = [
    "EngineModel",
    "EngineSpec",
    "Phase",
    "dtype_breakdown",
    "engine_model",
    "fsdp_local_numel",
    "zero12_partition",
    "zero3_partitions",
    "zero3_subgroups",
]
