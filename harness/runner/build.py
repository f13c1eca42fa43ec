"""Everything before the first step, in the order it must happen: data, model, engine,
checkpoint restore, observer, memory tracker, step guard. Shared by `harness.train` and
`harness.prune`, so a pruned model is loaded, trained and saved exactly as a trained one.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from harness.checkpoint import CheckpointManager, ResumeState
from harness.config import INSTRUCTION_FORMATS, DataConfig, ParallelLayout, RunConfig, aux_loss_coefficient, config_to_dict, default_lr
from harness.data import (
    BatchSampler,
    PackedData,
    SequenceSlice,
    StreamSampler,
    describe_consumption,
    eos_id,
    load_packed,
    load_tokenizer,
    prepare_data,
    stop_preparation_when,
)
from harness.distributed import DistInfo
from harness.engine import EnginePlan, build_engine
from harness.errors import ConfigError
from harness.log import get_logger
from harness.memory import StepMemoryTracker
from harness.models import ModelSpec, model_spec, twin_spec
from harness.observability import Observer
from harness.reliability import StepGuard, entering, signal_received
from harness.runner.data_checks import vocabulary_problem
from harness.runner.trainer import Trainer
from harness.training import RouterLoss, loss_for

log = get_logger(__name__)


def prepare(model_name: str, data: DataConfig, info: DistInfo) -> PackedData:
    """The data cache of the data section (the tokenizer: the model's, where `data.tokenizer` names
    none), prepared once per file system under its lock (the other ranks wait for it on the file
    system, not in a collective that would time out), then memory-mapped."""
    entering("preparing the data")
    stop_preparation_when(signal_received)  # a stop while a tokenizer pool runs: it ends the pool within a batch
    return load_packed(prepare_data(model_name, data, progress=info.local_rank == 0), block_bos=data.block_bos)


def check_eval_split(cfg: RunConfig, data: PackedData, info: DistInfo) -> None:
    """An eval split too small for one block of `seq_len` (a few documents at `data.eval_fraction`)
    means no evaluation, said once; pruning, which measures eval before and after, refuses it."""
    if data.n_blocks("eval"):
        return
    held = (
        f"the eval split holds {data.tokens['eval']} tokens at data.eval_fraction={cfg.data.eval_fraction}, "
        f"less than one block of {cfg.data.seq_len}"
    )
    if cfg.prune.enabled:
        raise ConfigError(f"{held}; {cfg.prune.named} measures eval perplexity: raise data.eval_fraction or give more data")
    if info.is_main:
        log.warning(f"data: {held}: the run does not evaluate (raise data.eval_fraction to evaluate)")


def make_sampler(cfg: RunConfig, data: PackedData, layout: ParallelLayout, info: DistInfo) -> BatchSampler | StreamSampler:
    """The training batches: from the cache (world-size invariant) or streamed (`data.streaming`);
    read per data-parallel rank of the layout, each rank of a sequence group its slice."""
    piece, world, rank = SequenceSlice.of(layout, info.rank)
    if cfg.data.streaming:
        tok = load_tokenizer(data.tokenizer_dir)
        sampler: BatchSampler | StreamSampler = StreamSampler(
            cfg.data, tok, eos_id(tok, cfg.data), cfg.micro_batch_size, cfg.grad_accum, world, rank, piece
        )
    else:
        sampler = BatchSampler(data, cfg.micro_batch_size, cfg.grad_accum, world, rank, cfg.data.seed, piece)
    if not cfg.data.streaming and sampler.global_batch > data.n_blocks("train"):
        raise ConfigError(
            f"one step's global batch ({sampler.global_batch} blocks = micro_batch_size*grad_accum*world "
            f"{cfg.micro_batch_size}*{cfg.grad_accum}*{world}) exceeds the {data.n_blocks('train')} "
            f"training blocks of {cfg.data.seq_len} tokens; lower micro_batch_size/grad_accum or give more data"
        )
    line, repeats = describe_consumption(data, cfg.data, cfg.steps, sampler.global_batch, cfg.data.streaming)
    log.info(line)
    if repeats:
        log.warning(f"{line.removeprefix('data: ')}: the run repeats its training data; lower steps or give more data")
    return sampler


def describe_lr(cfg: RunConfig) -> str:
    """The run's learning rate, and where it is the default for what is trained, which default."""
    value, why = default_lr(cfg)
    return f"lr {cfg.optim.lr:g}" + (f" (optim.lr's default for {why})" if cfg.optim.lr == value else "")


def check_tokenized_vocabulary(spec: ModelSpec, data_vocab: int) -> None:
    """A checkpoint's embedding must hold every token id of the data (a preset's is sized to the
    data): else the first forward ends in an IndexError on every rank. Pre-flight refuses what it
    can know before tokenizing (`data_checks.vocabulary_problem`); a tokenizer's size is known here."""
    rows = getattr(spec.config.get_text_config(), "vocab_size", None)
    if spec.directory is not None and (problem := vocabulary_problem(spec.name, rows, data_vocab)) is not None:
        raise ConfigError(problem)


def build_run(cfg: RunConfig, plan: EnginePlan, info: DistInfo, twin_layers: int | None = None) -> tuple[Trainer, ResumeState]:
    """Data, model, engine, checkpoint restore, observer: everything before the first step
    (shared with `python -m harness.prune`), the engine from pre-flight's plan. Returns the trainer and the restored state.
    `twin_layers`: build the model's small twin instead (`harness.models.twin_spec`; the check for silent wrong results)."""
    strategy = plan.strategy
    torch.manual_seed(cfg.seed)
    data = prepare(cfg.model.name, cfg.data, info)
    check_eval_split(cfg, data, info)
    started = time.perf_counter()
    spec = model_spec(cfg.model.name, vocab_size=data.vocab_size, seed=cfg.model.seed)
    check_tokenized_vocabulary(spec, data.vocab_size)
    if twin_layers is not None:
        spec = twin_spec(spec, twin_layers)
    labelled = cfg.data.format in INSTRUCTION_FORMATS  # blocks carry (input_ids, labels): loss on the responses only
    router = RouterLoss(aux_loss_coefficient(cfg.moe))  # a mixture-of-experts router's loss: attached to the built model
    loss_fn = functools.partial(loss_for(plan.layout.splits_sequences, labelled), chunk_size=cfg.memory.loss_chunk_size, router=router)
    if plan.taken and info.is_main:
        log.info(f"run config values taken from outside it: {'; '.join(plan.taken)}")
    if plan.launcher_said and info.is_main:
        log.info(f"accelerate launch settings harness does its own way: {'; '.join(plan.launcher_said)}")
    entering(f"building the {plan.kind} engine and loading the model (any extension build lock included)")
    engine = build_engine(spec, cfg, plan, info, loss_fn)  # built, sharded and filled (LoRA: adapters) inside
    # the coefficient (auto: the model config's where a router trains), or a refusal; the balance over the engine's sequence group
    routing = router.attach(engine.module, engine.sequence_group)
    sampler = make_sampler(cfg, data, plan.layout, info)
    ckpt = CheckpointManager(cfg, strategy, info, engine, tokenizer_dir=data.tokenizer_dir, per_rank={"data": sampler})
    entering("restoring the checkpoint")
    resumed = ckpt.restore()  # step 0, or the checkpoint's step (= data position) with optimizer, RNG, schedule, stream position
    observer = Observer(
        cfg.output_dir,
        config_to_dict(cfg),
        cfg.logging,
        info.rank,
        info.world_size,
        cfg.steps,
        seq_len=cfg.data.seq_len,
        device=cfg.device,
        precision=cfg.precision,
        model_config=engine.module.config,
        start_step=resumed.step,
    )
    tracker = StepMemoryTracker(
        engine.model,
        engine.optimizer,
        enabled=cfg.memory.track,
        category_every=cfg.memory.track_every,
        snapshot_dir=os.path.join(cfg.output_dir, "memory_snapshot") if cfg.memory.snapshot else None,
        layer_hooks=cfg.memory.layer_hooks,
        storage=engine.memory_storage(),
    )
    guard = StepGuard(cfg.checkpoint, info, engine, tracker, lambda: ckpt.last_path, resumed.step)  # NaN policy, stop signals
    log.info(
        f"{strategy.name} ({plan.kind}) x{info.world_size} on {info.device}, {cfg.precision} "
        f"({plan.precision.master_weights}), optim {cfg.optim.name}{' (CPU-offloaded)' if cfg.optim.cpu_offload else ''}"
        f"{f' ({plan.host_optimizer})' if plan.host_optimizer else ''}, "
        f"{engine.num_parameters():,} params, "
        f"global batch {sampler.global_batch} x {cfg.data.seq_len} tokens, {describe_lr(cfg)}"
        + (f", {plan.layout.describe()} ({engine.sequence_split_by})" if plan.layout.splits_sequences else "")
        + (f", {routing}" if routing else "")
        + (f", {plan.layout.describe()} (transformers' expert plan)" if plan.layout.splits_experts else "")
    )
    trainer = Trainer(
        cfg,
        info,
        engine,
        data,
        sampler,
        observer,
        tracker,
        guard,
        ckpt,
        skipped=int(resumed.counters.get("skipped_steps", 0)),
        started_at=started,
        router=router if router.active else None,
    )
    return trainer, resumed
