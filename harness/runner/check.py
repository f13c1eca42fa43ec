"""The check for silent wrong results: `harness.train --check`, seconds before a long job.

A run that is wrong without failing (gradients never reduced across ranks, a loss scaled by
the wrong accumulation factor, a tied weight never updated on uneven shards, packed examples
attending to each other) trains on and ends with a worse model and no error. The check runs
the user's command on a small twin of the model (`harness.models.twin_spec`: the same
architecture and widths, `TWIN_LAYERS` blocks) for `CHECK_STEPS` steps, under the user's
exact strategy, precision, accumulation, packing and LoRA/QLoRA at the launcher's world
size, through the same `build_run` and `Trainer` as training; and compares every step's
loss, every parameter's reduced gradient and update with a reference: the same global batch
computed the plainest way (`reference_config`: fp32, one process, accumulated over the run's own
micro-batches with the memory techniques that leave the arithmetic unchanged, packed examples
unpacked into rows of their own).

The reference is computed by every rank alone, in its own process, before the process group
starts (`run_check`): with no group, every collective harness issues falls back to a world of
one by itself, so the reference is a world-1 run of the same code and nothing in it can
depend on the launch under test; no tensor travels between ranks or nodes (each rank compares
its own shards against its own copy; only per-parameter sums are gathered); and it costs the
wall time of one small run, in parallel on every rank's device. The price, the twin whole on
each rank's device for a few seconds (two blocks, but the whole vocabulary and, in a mixture of
experts, every expert), is planned before it runs and said (`plan_reference`).

In bf16 each rank computes the reference twice, in fp32 and then in bf16 (`rounding_reference_config`):
their difference is what bf16's rounding does to each gradient of the step, and a bf16 run's first-step
gradients are bounded by it rather than by bf16's worst case (`harness.runner.check_compare.rounding_bounds`),
fine enough to see a bug whose error is a few times bf16's rounding.

Not covered (refused in one line): streaming data (each rank reads its own stream: no global
batch to recompute), fp16 (the gradients read before the step are loss-scaled), the optimizer
stepped inside backward (no gradient survives backward). Sequence parallelism and expert
parallelism are undone in `reference_config` (whole sequences, every expert in the one process, the
data-parallel world's global batch); the run's gradients are read through `Engine.shards()`, which
covers any engine that reports its shards.

A mixture-of-experts router's load-balancing loss is checked as the run adds it: per micro-batch
(transformers' definition: the balance of one forward's tokens), averaged over the step's
micro-batches and ranks (`harness.training.router`). Each reference micro-batch is one of the
run's (the run's sampler gives micro-batch a of data rank r the blocks starting at (a * data + r)
* micro, the reference's micro-batch a * data + r), so the trainer's own average over micro-batches
is the run's. Under sequence parallelism the run's ranks balance their whole sequences together
(`harness.training.router.whole_sequences`), as the reference does. Packed examples are unpacked
with the segments that hold no label kept, as the run routes them, and the rows' padding, which the
run never routes, is masked out of the reference's balance (`ReferenceSampler`). The aux loss is compared each step
beside the loss, and its weight shows in every router's and expert's gradient.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import time
from dataclasses import dataclass, field

import torch

from harness.config import INSTRUCTION_FORMATS, ParallelLayout, RunConfig, Strategy, load_config, load_strategy
from harness.data import unpack_with_origin
from harness.distributed import Collectives, DistInfo, launch_env, pick_device
from harness.engine import Engine, EnginePlan, plan_engine
from harness.errors import EXIT_OK, EXIT_WRONG_RESULTS, ConfigError, StopRequested
from harness.log import get_logger
from harness.memory import ACTIVATION_CHECKPOINTING, CHUNKED_LOSS, available_bytes
from harness.models import clean_name, model_spec
from harness.observability import format_bytes
from harness.planner import PlanError, estimate
from harness.reliability import entering, steps_discarded
from harness.runner.build import build_run
from harness.runner.check_compare import (
    DETECTION_LIMIT,
    UNIT_ROUNDOFF,
    Part,
    Verdict,
    drift_allowance,
    failure_hint,
    grad_bound,
    judge,
    merge,
    overall,
    relative_errors,
    rounding_bounds,
    sums,
    update_bound,
)
from harness.runner.command import run_command
from harness.runner.preflight import preflight
from harness.runner.trainer import Trainer
from harness.training import RouterLoss

log = get_logger(__name__)
TWIN_LAYERS = 2
CHECK_STEPS = 2


def check_config(cfg: RunConfig) -> RunConfig:
    """The user's run as the check runs it: the same training recipe, `CHECK_STEPS` steps, its
    outputs under `<output_dir>/check/run` (nothing of the run's own directory is touched)."""
    if cfg.data.streaming:
        raise ConfigError(
            "--check needs map-style data (data.streaming=false): a streamed step has no global batch to recompute at world 1"
        )
    if cfg.precision == "fp16":
        raise ConfigError("--check does not cover precision=fp16 (its gradients are loss-scaled until the step); check with bf16 or fp32")
    if cfg.memory.optimizer_in_backward:
        raise ConfigError("--check does not cover memory.optimizer_in_backward=true (no gradient survives backward); check without it")
    twin = copy.deepcopy(cfg)
    twin.steps, twin.eval_every = CHECK_STEPS, 0
    twin.output_dir = os.path.join(cfg.output_dir, "check", "run")
    twin.logging.wandb = twin.logging.plots = twin.logging.progress = False
    twin.memory.track = False
    twin.checkpoint.every, twin.checkpoint.save_final, twin.checkpoint.export_hf = 0, False, False
    twin.checkpoint.resume, twin.checkpoint.overwrite = "none", True
    twin.prune.method = "none"
    if twin.lora.dropout:
        log.info(f"check: lora.dropout {twin.lora.dropout:g} -> 0 (random masks differ between a sharded run and its reference)")
        twin.lora.dropout = 0.0
    return twin


def reference_config(twin: RunConfig, world: int, rank: int) -> RunConfig:
    """The same global batch, computed the plainest way: one process, fp32, in the run's micro-batches
    (the global batch `micro_batch_size * grad_accum * data ranks` accumulated over `grad_accum * data
    ranks` of them: the sampler deals the same blocks at any split, and the reference's micro-batch
    j is the run's micro-batch j // data of data rank j % data), with the two memory techniques that
    leave the arithmetic as it is (activation checkpointing recomputes the same forward, the chunked
    loss sums the same token losses), so a reference fits wherever the run's micro-batch does; none
    of the rest (compile, offload, tiling, the optimizer in backward)."""
    ref = copy.deepcopy(twin)
    ref.strategy, ref.precision = "ddp", "fp32"
    # the sampler's global batch: a sequence-parallel group reads one data-parallel rank's samples
    data = ParallelLayout.of(twin.parallel, world).data
    ref.micro_batch_size, ref.grad_accum, ref.global_batch_size = twin.micro_batch_size, twin.grad_accum * data, None
    m = ref.memory
    m.activation_offload, m.offload_checkpoint_inputs, m.compile, m.activation_memory_budget = False, False, "none", None
    m.tiled_mlp, m.tiled_mlp_tokens, m.optimizer_in_backward = 0, 0, False
    ref.optim.cpu_offload = False
    ref.parallel.sequence = 1  # whole sequences: what sequence parallelism must compute
    ref.parallel.expert = 1  # every expert in the one process: what expert parallelism must compute
    ref.output_dir = os.path.join(os.path.dirname(twin.output_dir), f"reference-rank{rank}")
    return ref


def rounding_reference_config(ref: RunConfig) -> RunConfig:
    """The reference again, computed in bf16 (one process, the module cast): its difference from the
    fp32 reference is what bf16's rounding alone does to each gradient of this step, the measure a
    bf16 run's first-step bounds are taken from (`harness.runner.check_compare.rounding_bounds`)."""
    rounded = copy.deepcopy(ref)
    rounded.precision = "bf16"
    rounded.output_dir = ref.output_dir + "-bf16"
    return rounded


@dataclass
class Record:
    """One rank's view of a run: losses, and its part of each gradient (per step) and weight (initial, then after each step)."""

    losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)  # the router's load-balancing loss (nan: no router)
    grads: list[list[Part]] = field(default_factory=list)
    weights: list[list[Part]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # parameter names in model order
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    seconds: float = 0.0  # building and running it


def grad_parts(engine: Engine) -> list[Part]:
    parts = []
    for shard in engine.shards():
        if shard.param.requires_grad:
            g = shard.grad()
            parts.append(Part(clean_name(shard.name), shard.start, shard.end, None if g is None else g.detach().float().cpu().clone()))
    return parts


def weight_parts(engine: Engine) -> list[Part]:
    """This rank's weights: the fp32 master where the engine keeps one (what the optimizer steps)."""
    parts = []
    for shard in engine.shards():
        master = shard.master()
        values = master if master is not None else shard.working()
        if values.is_floating_point():  # a quantized base's codes are bit patterns
            parts.append(Part(clean_name(shard.name), shard.start, shard.end, values.detach().float().cpu().clone()))
    return parts


def record(trainer: Trainer) -> Record:
    """Train the check's steps, recording gradients before each step and weights after it."""
    engine, rec = trainer.engine, Record()
    for shard in engine.shards():  # names as the model's own (activation checkpointing and compile wrap modules)
        rec.order.append(clean_name(shard.name))
        rec.shapes[clean_name(shard.name)] = tuple(shard.shape)
    rec.weights.append(weight_parts(engine))
    trainer.before_step = lambda step: rec.grads.append(grad_parts(engine))
    for step in range(CHECK_STEPS):
        if not trainer.train(step, step + 1):
            raise StopRequested("a stop request ended the check")
        trainer.started_at = None  # time to first step: said once
        rec.losses.append(trainer.loss_mean)
        rec.aux_losses.append(trainer.aux_loss)
        rec.weights.append(weight_parts(engine))
    trainer.close()
    return rec


def whole(parts: list[Part]) -> dict[str, torch.Tensor | None]:
    """The reference's parts are whole tensors (one process)."""
    return {p.name: p.values for p in parts}


def updates(after: list[Part], before: list[Part]) -> list[Part]:
    prior = {(p.name, p.start): p.values for p in before}
    return [Part(p.name, p.start, p.end, p.values - prior[(p.name, p.start)]) for p in after if p.values is not None]


def step_tokens(cfg: RunConfig, world: int) -> int:
    """The tokens of one step's global batch: every data-parallel rank's (the ranks of a sequence
    group share their samples, each training its slice)."""
    return cfg.micro_batch_size * cfg.grad_accum * (world // cfg.parallel.sequence) * cfg.data.seq_len


def stage_width(config, seq_len: int) -> int:
    """The longest dot product inside a stage of the model: its hidden or MLP width, or attention's over the sequence."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return max(int(getattr(text, "hidden_size", 0) or 0), int(getattr(text, "intermediate_size", 0) or 0), seq_len)


def step_bound(cfg: RunConfig, world: int, compute: torch.dtype) -> float:
    """The worst-case gradient bound of one step of `cfg` at `world` ranks, computed in `compute`
    (`harness.runner.check_compare.grad_bound`)."""
    width = stage_width(model_spec(cfg.model.name).config, cfg.data.seq_len)  # the twin keeps the model's widths
    return grad_bound(compute, step_tokens(cfg, world), TWIN_LAYERS, width)


def check_bounds(plan: EnginePlan, world: int) -> float:
    """The gradient bound of the run's first step (`harness.runner.check_compare`), or a refusal
    where it could no longer see the planted bugs (`DETECTION_LIMIT`): a step too large."""
    cfg = plan.config
    tokens = step_tokens(cfg, world)
    g_bound = step_bound(cfg, world, plan.precision.compute_dtype)
    if g_bound >= DETECTION_LIMIT:
        raise ConfigError(
            f"--check at {tokens:,} tokens a step under precision={cfg.precision}: its rounding bound {g_bound:.3g} would let errors "
            f"of {DETECTION_LIMIT:g} pass, as large as the bugs it must find; check with fewer tokens a step (micro_batch_size, "
            "grad_accum or data.seq_len: the recipe is checked, not the batch size) or with precision=fp32"
        )
    return g_bound


def first_step_bounds(refs: list[Record], g_bound: float, floor: float, data_ranks: int, comm: Collectives) -> dict[str, float]:
    """A bf16 run's first-step gradient bounds, from the rounding its bf16 reference (`refs[1]`)
    measured against the fp32 one (`refs[0]`), the largest over ranks (`rounding_bounds`); `floor`
    the step's fp32 bound, `g_bound` its worst case in bf16."""
    measured = relative_errors(whole(refs[1].grads[0]), whole(refs[0].grads[0]))
    return rounding_bounds(comm.gather_object(measured), g_bound, floor, UNIT_ROUNDOFF[torch.bfloat16], data_ranks)


def compare(run: Record, ref: Record, g_bound: float, comm: Collectives, first_bounds: dict[str, float] | None = None) -> Verdict:
    """The initial weights, then each step's gradients, updates and loss, each parameter in model order;
    from the second step on each gradient's bound allows for the weights the run has left the
    reference's by (`drift_allowance`). `first_bounds`: the first step's gradient bounds where the
    rounding was measured (`first_step_bounds`; the worst case `g_bound` for any parameter it lacks)."""
    verdict = Verdict()

    def judge_parts(step: int, what: str, mine: list[Part], reference: list[Part], bounds: float | dict[str, float]) -> dict:
        expected = whole(reference)
        totals = merge(comm.gather_object(sums(mine, expected)))
        judge(verdict, step, what, totals, [n for n in ref.order if expected.get(n) is not None], bounds, ref.shapes)
        return totals

    judge_parts(0, "initial weights", run.weights[0], ref.weights[0], g_bound)
    drift = 0.0  # the last update's relative error: how far the run's weights have left the reference's
    for step in range(CHECK_STEPS):  # parameters first: a difference is named where it is
        allowance = drift_allowance(drift, whole(ref.grads[step]), whole(ref.grads[step - 1])) if step else {}
        grad_bounds = {name: g_bound + allowance.get(name, 0.0) for name in ref.order}
        measured = first_bounds if first_bounds is not None and step == 0 else {}
        judge_parts(step + 1, "gradient", run.grads[step], ref.grads[step], {n: measured.get(n, b) for n, b in grad_bounds.items()})
        ref_update = updates(ref.weights[step + 1], ref.weights[step])
        update_bounds = {name: update_bound(bound) for name, bound in grad_bounds.items()}
        drift = overall(judge_parts(step + 1, "update", updates(run.weights[step + 1], run.weights[step]), ref_update, update_bounds))
        loss, ref_loss = run.losses[step], ref.losses[step]
        verdict.add(step + 1, "loss", "the loss", abs(loss - ref_loss) / abs(ref_loss), g_bound, f" ({loss:.7g} vs {ref_loss:.7g})")
        aux, ref_aux = (run.aux_losses[step], ref.aux_losses[step]) if ref.aux_losses else (math.nan, math.nan)
        if not math.isnan(ref_aux):  # a router: its balance over the same micro-batches' tokens
            relative = abs(aux - ref_aux) / abs(ref_aux) if ref_aux else abs(aux)
            verdict.add(step + 1, "aux loss", "the router's aux loss", relative, g_bound, f" ({aux:.7g} vs {ref_aux:.7g})")
    return verdict


def plan_reference(ref: RunConfig, ddp: Strategy, device: torch.device) -> str:
    """The reference's peak on this rank's device, planned before it runs (`harness.planner` on the
    twin's blocks, as one fp32 DDP process of the run's micro-batches: what `reference_run` builds),
    said; refused in one line where it would not fit the memory this rank may count on (every
    rank of a node computes its reference at the same time). A reference the planner does not
    model is said to be unplanned, with the planner's reason."""
    target = "cuda" if device.type == "cuda" else "cpu"
    try:
        planned = estimate(ref, 1, target=target, strategy=ddp, layers=TWIN_LAYERS)
    except PlanError as exc:
        return f"not planned ({exc})"
    peak, free = planned.peak.total, available_bytes(device)
    if peak > free:
        m, changes = ref.memory, []
        if m.activation_checkpointing != "full":
            changes.extend(ACTIVATION_CHECKPOINTING.overrides())
        if not CHUNKED_LOSS.is_on(m):
            changes.extend(CHUNKED_LOSS.overrides())
        changes.append("a smaller micro_batch_size or data.seq_len (the recipe is checked, not the batch size)")
        raise ConfigError(
            f"--check: its world-1 reference (fp32, {TWIN_LAYERS} blocks, micro-batch {ref.micro_batch_size} x {ref.data.seq_len}) "
            f"plans a peak of {format_bytes(peak)} on {device}, which has {format_bytes(free)} free for this rank; "
            f"check with {' or '.join(changes)}"
        )
    return f"planned peak {format_bytes(peak)} on {device} ({format_bytes(free)} free)"


def reference_run(ref: RunConfig, local_rank: int, planned: bool = True) -> Record:
    """The reference on this rank alone, before any process group exists (module docstring);
    `planned=False` for the bf16 reference, which runs after the fp32 one in the same micro-batches
    and so within its peak."""
    started = time.perf_counter()
    device = pick_device(ref.device, local_rank)
    ddp = load_strategy("ddp")
    memory = plan_reference(ref, ddp, device) if planned else "within the fp32 reference's peak"
    plan = plan_engine(ref, ddp, 1, device, None, env={})
    trainer, _ = build_run(plan.config, plan, DistInfo(0, 1, local_rank, device, None), twin_layers=TWIN_LAYERS)
    router = trainer.router if trainer.router is not None and trainer.router.active else None
    trainer.sampler = ReferenceSampler(trainer.sampler, router)
    m = ref.memory
    log.info(
        f"check: reference: {ref.grad_accum} micro-batches of {ref.micro_batch_size} x {ref.data.seq_len} tokens, {ref.precision}, "
        f"one process, activation checkpointing {m.activation_checkpointing}, loss chunk {m.loss_chunk_size or 'none'}; {memory}"
    )
    rec = record(trainer)
    rec.seconds = time.perf_counter() - started
    steps_discarded("joining the process group after the check's reference")
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


class ReferenceSampler:
    """The reference's batches: every packed example in a row of its own (`harness.data.unpack_with_origin`);
    with a router, the segments without a label kept too, and the router told which tokens the run
    routed (not a row's padding). A reference micro-batch is one of the run's (`reference_config`),
    so its router's loss is that micro-batch's; the trainer averages it over the micro-batches."""

    def __init__(self, sampler, router: RouterLoss | None) -> None:
        self.inner, self.global_batch = sampler, sampler.global_batch
        self.router = router

    def batch(self, step: int, micro_index: int) -> torch.Tensor:
        packed = self.inner.batch(step, micro_index)
        rows, origin = unpack_with_origin(packed, every_segment=self.router is not None)
        if self.router is not None:
            self.router.routed_tokens.append(origin >= 0)  # origin -1: a row's padding, never routed in the run
        return rows


def describe(cfg: RunConfig, plan: EnginePlan, info: DistInfo, router: RouterLoss | None) -> str:
    packing = f", instruction data {'packed' if cfg.data.packing else 'unpacked'}" if cfg.data.format in INSTRUCTION_FORMATS else ""
    sequence = f", sequence parallel {plan.layout.sequence}" if plan.layout.splits_sequences else ""
    sequence += f", expert parallel {plan.layout.expert}" if plan.layout.expert > 1 else ""
    lora = f", LoRA r={cfg.lora.r}{' ' + cfg.lora.quantize if cfg.lora.quantize != 'none' else ''}" if cfg.lora.enabled else ""
    routed = (
        "" if router is None or not router.active else f", router aux loss x{router.coef:g}" if router.coef else ", router aux loss off"
    )
    features = f"{sequence}{packing}{lora}{routed}"
    return (
        f"{plan.strategy.name} ({plan.kind}) x{info.world_size}, {cfg.precision}, micro-batch {cfg.micro_batch_size} x "
        f"grad_accum {cfg.grad_accum}{features}; twin of {cfg.model.name} with {TWIN_LAYERS} layers, {CHECK_STEPS} steps"
    )


def check_body(cfg: RunConfig, plan: EnginePlan, info: DistInfo, refs: list[Record], g_bound: float, began: float) -> int:
    """The run under the launch, compared with the fp32 reference `refs[0]` (and, in bf16, its first
    step's gradients within the rounding `refs[1]` measured); the verdict said, its exit code returned."""
    trainer, _ = build_run(cfg, plan, info, twin_layers=TWIN_LAYERS)
    run = record(trainer)
    comm, ref = Collectives(), refs[0]
    first = None
    if len(refs) > 1:
        floor = step_bound(plan.config, info.world_size, torch.float32)
        first = first_step_bounds(refs, g_bound, floor, plan.layout.data, comm)
    verdict = compare(run, ref, g_bound, comm, first)
    worst, what = verdict.summary(), describe(cfg, plan, info, trainer.router)
    log.info(f"check: {time.perf_counter() - began:.1f} s from the config read to the verdict (reference {ref.seconds:.1f} s)")
    if verdict.first is None:
        log.info(f"check passed: {what}: {verdict.compared} quantities within bounds (largest relative errors: {worst})")
    elif info.is_main:  # every rank reached the same verdict from the same gathered sums: one line
        log.error(f"check failed: {what}: {verdict.first.line()}")
        log.error(f"check: largest relative errors: {worst}")
        hint = failure_hint(plan.precision, verdict.first)
        if hint:
            log.error(hint)
    return EXIT_OK if verdict.first is None else EXIT_WRONG_RESULTS


def run_check(config: str | None, overrides: list[str]) -> int:
    """`harness.train --check`: pre-flight of the user's run, the reference on every rank alone,
    then the run under the launcher's world size, compared (exit 0, or `EXIT_WRONG_RESULTS`)."""
    refs: list[Record] = []
    bounds: list[float] = []
    began = time.perf_counter()

    def load() -> tuple[RunConfig, EnginePlan]:
        twin = check_config(load_config(config, overrides))
        plan = preflight(twin, load_strategy(twin.strategy))  # adopts the launcher's and the strategy file's settings
        rank, world, local_rank = launch_env()
        bounds.append(check_bounds(plan, world))  # before the reference: a step too large is refused at once
        entering("computing the check's world-1 reference")
        run = plan.config  # the twin as resolved
        ref = reference_config(run, world, rank)
        refs.append(reference_run(ref, local_rank))
        if plan.precision.compute_dtype == torch.bfloat16:  # bf16's rounding measured: the first step's fine bounds
            refs.append(reference_run(rounding_reference_config(ref), local_rank, planned=False))
        return twin, plan

    return run_command("harness", load, lambda cfg, plan, info: check_body(cfg, plan, info, refs, bounds[0], began))


__all__ = [
    "CHECK_STEPS",
    "TWIN_LAYERS",
    "check_bounds",
    "check_config",
    "plan_reference",
    "reference_config",
    "rounding_reference_config",
    "run_check",
    "stage_width",
    "step_bound",
    "step_tokens",
]
