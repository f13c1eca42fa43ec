"""The run config: typed dataclasses, loaded from YAML/JSON, overridden by `key=value`.

Every section is a dataclass so that an unknown key is an error naming the closest valid
key, instead of a silently ignored typo.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field, fields
from typing import Any, ClassVar

from harness.config.presets import is_preset
from harness.config.vocabulary import (  # the fields' types
    INSTRUCTION_FORMATS,
    AcMode,
    CompileMode,
    DataFormat,
    Device,
    ExpertScore,
    LoraQuantize,
    OnNonfinite,
    OptimName,
    Precision,
    PruneAllocation,
    PruneBase,
    PruneDecision,
    PruneMethod,
    PruneScope,
    PruneTargets,
    Schedule,
    StatDtype,
    TokenDtype,
)


class Section:
    """Every config section: written while the config is loaded and resolved, read-only once
    pre-flight has resolved it (`freeze`): components build themselves from their section of the
    resolved config, so none may change what another reads. A copy (`copy.deepcopy`: a variant
    the planner costs, the check's twin) is writable again."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise FrozenInstanceError(f"the run config is resolved and read-only: cannot set {type(self).__name__}.{name}")
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_frozen"}


def freeze(cfg: Section) -> Section:
    """Make `cfg` and every section in it read-only (in place); returns it."""
    for f in fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if isinstance(value, Section):
            freeze(value)
    object.__setattr__(cfg, "_frozen", True)
    return cfg


@dataclass
class ModelConfig(Section):
    """What is trained (`harness.models`)."""

    # a preset (tiny-llama, small-llama, llama-1.6b, llama3-8b; llama3-70b for the planner only), a local
    # path or a hub id of any transformers causal LM (safetensors, single or sharded, or .bin)
    name: str = "tiny-llama"
    seed: int = 0  # random-init seed for presets (the same on every rank)
    max_seq_len: int | None = None  # the longest sequence the model takes; unset: the model's max positions


@dataclass
class DataConfig(Section):
    """What is trained on (`harness.data`): documents split by document, tokenized once into a cache."""

    # embedded or stdlib (corpora shipped with Python), a local file/dir (text, jsonl/json, parquet, .arrow), a
    # datasets folder (save_to_disk of a Dataset or a DatasetDict; a folder laid out as a Hub dataset repository:
    # README.md beside data/train-*.parquet...), a hub dataset, or a flat token file (.npy, raw .bin of
    # data.token_dtype); a dataset with an input_ids column is taken as pre-tokenized. A DatasetDict's train split
    # trains (calib by hash) and its validation/test split evaluates
    source: str = "embedded"
    text_field: str = "text"  # the column holding the text
    seq_len: int = 128  # packed block length, in tokens
    # held-out documents for evaluation; a split too small for one block is no evaluation (said; pruning refuses it)
    eval_fraction: float = 0.05
    # held-out documents for pruning calibration; a run that does not prune holds out none (they train) unless this
    # is written (a model trained to be pruned later: it never trains on its calibration documents)
    calib_fraction: float = 0.05
    # optional cap on the train split's tokens (unset: the whole corpus); the run states the tokens, blocks and
    # epochs its steps consume and warns when it repeats data
    max_tokens: int | None = None
    tokenizer: str | None = None  # tokenizer path; unset: the model's, else a BPE trained locally and cached
    vocab_size: int = 2048  # vocabulary of the locally trained tokenizer (and of pre-tokenized input without one)
    seed: int = 1234  # the document split's and the sampler's seed
    cache_dir: str | None = None  # where tokenizers and tokenized data are cached
    num_proc: int | None = None  # tokenizer processes preparing the cache; unset: the machine's cores (at most 16)
    # read and tokenize on the fly, each rank its own part of the stream (corpora larger than the disk); its
    # position is saved in checkpoints (resume at the same world size)
    streaming: bool = False
    eos_id: int | None = None  # document separator for pre-tokenized input without a tokenizer
    token_dtype: TokenDtype = "uint16"  # element type of a raw .bin token file
    stream_eval_blocks: int = 256  # streaming: eval and calib blocks read from the start of the stream
    # text: loss on every token. instruction: a local JSON lines file of {"prompt", "response"}, {"messages": [{role,
    # content}, ...]}, Alpaca or ShareGPT records (each detected from its fields; alpaca or sharegpt names the
    # layout), rendered with the tokenizer's chat template when it has one. Roles: system, user/human, assistant/gpt/
    # model/bot (others refused); content a string or OpenAI-style text parts (concatenated; other parts refused); a
    # split whose examples have no labelled token is refused. Labelled (the loss): the response, or
    # what TRL's assistant-only loss labels - the template's {% generation %} mask where it has one, else each
    # assistant turn after its header through its end-of-turn token and the newline after it (ChatML: \n + answer +
    # <|im_end|> + \n, as TRL's ChatML training templates); without a template, "role: content" lines with each answer
    # and its EOS labelled, never the "assistant:" header
    format: DataFormat = "text"
    # instruction data: pack whole examples into blocks (best-fit decreasing; positions restart per example, so
    # attention stays inside each example; none cut or dropped); false: one example per block, padded (padding
    # carries no loss)
    packing: bool = True
    # text data: where the tokenizer puts a BOS before every text (Llama, Gemma), every block starts with one (a
    # block cut mid-document gets it before its seq_len - 1 tokens; said once); false: blocks are the stream cut
    # every seq_len tokens
    block_bos: bool = True

    @property
    def packs_examples(self) -> bool:
        """Whether a row holds several instruction examples (positions restarting at each), which
        attention must keep apart."""
        return self.format in INSTRUCTION_FORMATS and self.packing


@dataclass
class OptimConfig(Section):
    """The optimizer and its schedule (`harness.training`)."""

    # adamw/adam/sgd (torch, fp32 state; Adam/AdamW fused: one in-place kernel per tensor, as HF Trainer and
    # torchtitan build it); adamw_bf16 (bf16 moments), adamw_8bit, adamw_4bit (torchao, block-quantized moments;
    # FSDP2 shards them); paged_adamw_8bit (bitsandbytes; plain 8-bit on CPU; not under FSDP2). Use adamw when
    # memory allows, adamw_8bit when optimizer state is what does not fit (~4x less), adamw_4bit for ~8x less;
    # DeepSpeed runs only its own (adamw/adam/sgd). Bytes: notes/optimizers.md
    name: OptimName = "adamw"
    # unset: by what is trained (3e-3 for a preset from random init, 2e-5 for a full fine-tune of pretrained
    # weights, 2e-4 for LoRA; the start line says which); a changed lr on resume applies from the checkpoint's step
    lr: float | None = None
    weight_decay: float = 0.0  # decoupled weight decay (AdamW's)
    betas: tuple[float, float] = (0.9, 0.95)  # Adam's moment decay rates
    eps: float = 1e-8  # Adam's denominator term
    schedule: Schedule = "cosine"  # the learning rate's shape after warm-up
    warmup_steps: int = 5  # linear warm-up from 0
    min_lr_ratio: float = 0.1  # the schedule's floor, as a fraction of lr
    grad_clip: float = 1.0  # the gradient norm's clip; 0 disables clipping
    cpu_offload: bool = False  # torchao's CPUOffloadOptimizer: state and step on the host (one CUDA GPU)


@dataclass
class MemoryConfig(Section):
    """Memory techniques (`harness.memory`). All off by default."""

    # full, selective (every memory.ac_every-th block), op (save matmul outputs, recompute the rest)
    activation_checkpointing: AcMode = "none"
    ac_every: int = 2  # selective: checkpoint every k-th block
    activation_offload: bool = False  # saved activations to (pinned) host memory
    # only the inputs activation checkpointing keeps (one per checkpointed block) to pinned host memory, on a side
    # stream, the next block's fetched ahead in backward (CUDA); needs AC, not with activation_offload or compile
    offload_checkpoint_inputs: bool = False
    compile: CompileMode = "none"  # block or model: torch.compile
    activation_memory_budget: float | None = None  # compile's knapsack recomputation budget in [0, 1]; implies compile
    optimizer_in_backward: bool = False  # optimizer step fused into backward (DDP/FSDP2; composes with accumulation)
    loss_chunk_size: int = 0  # >0: chunked fp32 cross-entropy over the sequence (never materialises full logits); 0: plain
    # each block's MLP over this many sequence tiles (>1), recomputed in backward: its intermediates exist a tile at
    # a time (same gradients; one more MLP forward; composes with AC, compile, FSDP2, DeepSpeed, LoRA, MoE); 0: untiled
    tiled_mlp: int = 0
    tiled_mlp_tokens: int = 0  # or tiles of this many tokens (the count follows the sequence); one of the two
    # every step the platform's peak (GPU: max_memory_allocated/reserved; CPU: the process's resident high-water
    # mark), at no measurable cost; the split of the peak by category on sampled steps (memory.track_every)
    track: bool = True
    # the split by category on steps 0 and 1, every k-th step (0: never again) and after kill -USR2 <pid>: a split
    # step costs about two steps
    track_every: int = 100
    snapshot: bool = False  # memory snapshot (GPU pickle / CPU per-module report)
    layer_hooks: bool = False  # per-block memory after forward (debug)


@dataclass
class ParallelConfig(Section):
    """How the world's ranks split the work beyond data parallelism (`harness.engine`)."""

    # Ulysses sequence parallelism: each sample's sequence is split over this many consecutive ranks (the world
    # is data x sequence; global batch = micro x accum x world / N); attention swaps sequence slices for head
    # shares with two all-to-alls around sdpa (transformers' attention registry), positions and targets are the
    # whole sequence's, every token counted once in the loss; gradients reduced over the whole world. harness's
    # own under single/DDP/FSDP2; DeepSpeed's ALST under DeepSpeed (a file's sequence_parallel_size is taken
    # here). Must divide the world, data.seq_len, the attention and key/value heads; packed instruction data
    # keeps attention inside each example under the torch engines (the group's position ids gathered, causal
    # sdpa run per example: no S x S mask, which transformers builds at world 1) and is refused under DeepSpeed
    # (ALST's sdpa would cross examples); refused with pruning, optimizer-in-backward, sliding-window or
    # eager-only attention. Measured: notes/long_context.md
    sequence: int = 1
    # Expert parallelism: each MoE layer's experts are split over this many consecutive ranks (transformers' expert
    # plan: the model's `base_model_ep_plan`, its all-to-all dispatch); each rank still reads its own samples (the
    # global batch is unchanged), tokens travel to their experts' ranks and back. Expert gradients are summed over
    # the ranks holding the same experts, the rest over the world. Must divide the world and the model's experts;
    # strategy=ddp or fsdp (each expert range sharded over the ranks holding it, the rest over the world, one
    # mixed precision for both), in fp32 or bf16, not DeepSpeed; with parallel.sequence too; refused with LoRA, pruning,
    # optimizer-in-backward and a model without an expert plan. Measured: notes/moe.md
    expert: int = 1


@dataclass
class LoggingConfig(Section):
    """What a run reports (`harness.observability`): metrics.jsonl, W&B, progress, plots."""

    log_every: int = 1  # steps between logged lines (the steps between are folded in: means, maxima)
    wandb: bool = True  # W&B on rank 0; offline without an API key
    wandb_project: str = "harness"  # the W&B project
    run_name: str | None = None  # the W&B run's name; unset: W&B's
    progress: bool = True  # the progress line on the console
    plots: bool = True  # loss and memory plots at the end of the run
    peak_flops: float | None = None  # per device, overrides the GPU table (needed for MFU on CPU)


@dataclass
class CheckpointConfig(Section):
    """Saving, resuming and the non-finite policy (`harness.checkpoint`, `harness.reliability`)."""

    every: int = 0  # steps between checkpoints; 0: only at the end (with save_final)
    save_final: bool = False  # a checkpoint after the last step
    keep: int = 2  # checkpoints kept (the newest always)
    # none, auto (this run's latest) or a checkpoint path; steps below the checkpoint's step, or an older checkpoint
    # of this run while later ones exist, is refused (overwrite=true deletes the later ones, naming each)
    resume: str = "none"
    overwrite: bool = False  # replace this output directory's checkpoints and exports instead of refusing
    on_nonfinite: OnNonfinite = "skip"  # a non-finite loss or gradient norm: skip the update, or stop (exit 3)
    max_consecutive_skips: int = 10  # on_nonfinite=skip: this many skipped steps in a row stop the run (exit 3)
    export_hf: bool = False  # a Hugging Face model directory (safetensors + config + tokenizer) at the end, in <output_dir>/hf


@dataclass
class PruneConfig(Section):
    method: PruneMethod = "none"
    base: PruneBase = "wanda"  # gradprobe's base score (candidates and order)
    sparsity: float = 0.5
    pattern: str = "unstructured"  # unstructured | N:M, e.g. 2:4
    calib_samples: int = 16
    calib_seed: int = 0
    group_size: int = 0  # gradprobe: K decoder blocks probed together; 0 = chosen from memory (decision=original: one matrix)
    threshold: float = 0.0
    reduction: float = 0.1
    # The next four: None = the method's or decision mode's default (harness/config/prune_modes.py): rank/veto
    # exact, per_matrix, bf16, not sequential; Wanda and SparseGPT (and sparsegpt_fit): sequential, block by block;
    # original: veto, global (magnitude base), fp32, sequential.
    exact_target: bool | None = None
    # gradprobe: one of PRUNE_DECISIONS. veto (the default, GradProbe's own rule): the base score's order, the
    # probe's gradient growth vetoes candidates; rank and saliency measured worse; original: the reference's
    # low-memory streaming veto. prune.base, pool, threshold, reduction, stat_dtype, group_size: gradprobe's only.
    decision: PruneDecision = "veto"
    scope: PruneScope | None = None
    # decoder_linears: the Linears of the decoder blocks and their MoE layers' stacked expert tensors (each expert's
    # rows pruned as a Linear's, by its own tokens' inputs; SparseGPT, RIA and per-row or N:M rules on gpt-oss's
    # [experts, in, out] tensors leave them whole, said in the report); all_linears: the LM head too
    targets: PruneTargets = "decoder_linears"
    pool: float = 0.25  # exact-target GradProbe: probe (1 + pool) x target candidates
    sequential: bool | None = None  # measure each block (gradprobe: group) on the outputs of those already pruned
    schedule: list[float] | None = None  # iterative targets, e.g. [0.3, 0.4, 0.5]
    max_metric_increase: float = 0.1  # iterative schedule stops when eval loss rises more than this
    stat_dtype: StatDtype | None = None  # storage of gradient statistics
    finetune_steps: int = 0  # training steps after pruning (masks enforced)
    allocation: PruneAllocation = "uniform"  # per-block sparsity; owl: outlier-weighted (harness/pruning/experimental/owl.py)
    owl_lambda: float = 0.08  # OWL: block sparsities span target +- lambda
    owl_m: float = 5.0  # OWL: an outlier is a Wanda score above m x its block's mean
    # sparsegpt_fit: Adam epochs over the calibration set per block (0: SparseGPT alone), and their step size
    # (a fit the guard rejects is retried at a tenth of it, then SparseGPT's weights stay: harness/pruning/fit.py)
    fit_epochs: int = 1
    fit_lr: float = 1e-3
    # the fraction of each mixture-of-experts layer's experts to drop (0: none), by expert_score's measure; the
    # export removes them (router rows and all), routing as the smaller model meanwhile; with or without prune.method
    experts: float = 0.0
    # gradient: the probe's squared first-order loss change of removing each routed term (measured best);
    # reap: REAP's router-weighted output norm; frequency: the least used go; random: a seeded draw
    expert_score: ExpertScore = "gradient"

    @property
    def enabled(self) -> bool:
        """Whether the run prunes at all (`method: none` without `experts` does not)."""
        return self.prunes_weights or self.experts > 0

    @property
    def prunes_weights(self) -> bool:
        """Whether `method` prunes weights (as opposed to whole experts alone)."""
        return self.method != "none"

    @property
    def named(self) -> str:
        """The settings that make the run prune, as a refusal names them."""
        parts = ([f"prune.method={self.method}"] if self.prunes_weights else []) + (
            [f"prune.experts={self.experts:g}"] if self.experts else []
        )
        return " and ".join(parts) or "prune.method=none"


# Keys and values that once existed, with what replaced them: named in the refusal instead of a guess.
RENAMED = {
    "prune.recon_steps": "prune.fit_epochs (with prune.method=sparsegpt_fit)",
    "prune.recon_lr": "prune.fit_lr (with prune.method=sparsegpt_fit)",
    "prune.decision=reconstruct": "prune.method=sparsegpt_fit (SparseGPT's masks, then each block fitted by gradient steps)",
}


@dataclass
class LoraConfig(Section):
    """LoRA/QLoRA fine-tuning (`harness.models.lora`, built on `peft`): the base is frozen, the
    adapters train, so gradients and optimizer state exist for the adapters only."""

    enabled: bool = False  # train adapters on a frozen base; checkpoints hold the adapters and their optimizer state
    r: int = 8  # adapter rank
    alpha: float = 16.0  # scaling: alpha / r
    dropout: float = 0.0  # dropout on the adapter input
    target_modules: list[str] | None = None  # module names; unset: every linear layer of the decoder blocks (logged)
    # stacked expert tensors (`<module>.<parameter>`, e.g. experts.gate_up_proj: one rank-r pair per expert, peft's
    # target_parameters); unset: every stacked expert weight of a mixture-of-experts model's decoder blocks (logged),
    # none for a dense model; [] leaves the experts frozen. Stacked experts need lora.dropout=0
    target_parameters: list[str] | None = None
    # int8 or nf4 (QLoRA: the base quantized by bitsandbytes, on CPU or GPU: single/DDP; nf4 also sharded by FSDP2
    # and by DeepSpeed ZeRO-3, its 4-bit codes stored in the compute dtype, the scales on every rank); ZeRO-1/2, and
    # int8 under FSDP2 or DeepSpeed, refused in one line
    quantize: LoraQuantize = "none"


@dataclass
class MoeConfig(Section):
    """Mixture-of-experts routers (`harness.training.router`): the load-balancing loss, and each layer's
    expert load logged (train/aux_loss, moe/expert_load/layer_N: max/mean tokens per expert)."""

    # The router's load-balancing loss as transformers defines it for the family (its load_balancing_loss_func, per
    # micro-batch, averaged over the step's micro-batches and ranks), times this coefficient, added to the loss:
    # auto, the model config's router_aux_loss_coef wherever a router trains (none does under LoRA's frozen base);
    # a number, that coefficient; 0, off (still logged). A number for a model whose router transformers does not
    # expose is refused. train/loss stays the language-model loss; the start-up line says which coefficient
    aux_loss_coef: str = "auto"


@dataclass
class RunConfig(Section):
    """A run config is YAML or JSON; any key can be overridden on the command line as
    `section.key=value`. Unknown keys are errors that name the closest valid key."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    strategy: str | None = None  # a name in ds_configs/ or a JSON path; unset: the launcher's, else ddp
    # bf16_pure: bf16 weights with no fp32 master under every torch engine, FSDP2's shards included; only with
    # adamw_bf16/adamw_8bit/adamw_4bit, whose stochastic rounding keeps bf16 weights moving; not under DeepSpeed
    precision: Precision = "fp32"
    micro_batch_size: int = 4  # samples per rank per forward; global batch = micro x accum x world
    grad_accum: int = 1  # micro-batches per optimizer step
    global_batch_size: int | None = None  # optional check: must equal micro x accum x world
    steps: int = 50  # training steps
    eval_every: int = 0  # steps between evaluations; 0: only at the end
    eval_batches: int = 8  # eval micro-batches (global)
    seed: int = 0  # the run's torch seed
    output_dir: str = "runs/default"  # where metrics, plots and checkpoints go
    device: Device = "auto"  # auto (a GPU where there is one), cpu or cuda
    # The dotted keys the user wrote, set by `load_config` (a ClassVar, so not a config key); see `loading.is_given`.
    given_keys: ClassVar[frozenset[str] | None] = None

    def __post_init__(self) -> None:
        if self.optim.lr is None:  # not given: the default for what this run trains
            self.optim.lr = default_lr(self)[0]


# The learning rates used when `optim.lr` is not given, by what is trained: the values the
# field's recipes publish (torchtune's and axolotl's full fine-tunes of 1-8B models, 2e-5;
# LoRA/QLoRA, 2e-4 as in the QLoRA paper and peft's examples; a small model from random init, 3e-3).
FROM_SCRATCH_LR = 3e-3
FULL_FINETUNE_LR = 2e-5
ADAPTER_LR = 2e-4


def default_lr(cfg: RunConfig) -> tuple[float, str]:
    """The learning rate a run gets when `optim.lr` is not set, and why. A from-scratch rate on
    pretrained weights destroys them in a few steps (perplexity ~10^2 -> ~10^5 on a 270M model)."""
    if cfg.lora.enabled:
        return ADAPTER_LR, "LoRA adapters"
    if is_preset(cfg.model.name):
        return FROM_SCRATCH_LR, f"the preset {cfg.model.name} trained from random init"
    return FULL_FINETUNE_LR, "a full fine-tune of pretrained weights"
