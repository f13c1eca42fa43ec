"""The run config: typed dataclasses, loaded from YAML/JSON, overridden by `key=value`.

Every section is a dataclass so that an unknown key is an error naming the closest valid
key, instead of a silently ignored typo.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

from harness.config.presets import is_preset

# The choices of the enumerated keys, one definition each: a `Literal` type is the field's type,
# and the tuple of its values (`get_args`) is what the checks and the techniques read, so a new
# choice is added in one place and is checked everywhere.
# bf16_pure: bf16 weights with no fp32 master copy (only with an optimizer that keeps bf16 weights moving)
Precision = Literal["fp32", "bf16", "fp16", "bf16_pure"]
AcMode = Literal["none", "full", "selective", "op"]
CompileMode = Literal["none", "block", "model"]
LoraQuantize = Literal["none", "int8", "nf4"]
# text: loss on every token; the others (harness.data.instructions): records with labels - instruction detects
# prompt/response, messages, Alpaca or ShareGPT from each record's fields, alpaca and sharegpt name the layout
DataFormat = Literal["text", "instruction", "alpaca", "sharegpt"]
TokenDtype = Literal["uint16", "uint32"]  # element type of a raw .bin token file
Device = Literal["auto", "cpu", "cuda"]
# adamw/adam/sgd: torch, fp32 (parameter-dtype) state; adamw_bf16/_8bit/_4bit: torchao's optimizers
# (bf16 moments with stochastic rounding of bf16 weights; 8-/4-bit block-quantized moments);
# paged_adamw_8bit: bitsandbytes (paged through CUDA unified memory on a GPU, plain 8-bit on CPU)
OptimName = Literal["adamw", "adam", "sgd", "adamw_bf16", "adamw_8bit", "adamw_4bit", "paged_adamw_8bit"]
Schedule = Literal["cosine", "linear", "constant"]
OnNonfinite = Literal["skip", "stop"]
PruneMethod = Literal["none", "magnitude", "wanda", "sparsegpt", "gradprobe"]
# GradProbe's base scores: magnitude, wanda in harness.pruning.methods; gblm, taylor, ria (measured worse) in harness.pruning.experimental
PruneBase = Literal["magnitude", "wanda", "gblm", "taylor", "ria"]
# GradProbe's decision rule (harness/config/prune_modes.py); rank and saliency (measured worse): harness.pruning.experimental;
# reconstruct: block-streamed OBS masks, then the block's surviving weights fitted by gradient steps (harness.pruning.reconstruct)
PruneDecision = Literal["rank", "veto", "saliency", "original", "reconstruct"]
PruneAllocation = Literal["uniform", "owl"]  # owl (measured worse): harness.pruning.experimental.owl
PruneScope = Literal["per_matrix", "global"]
PruneTargets = Literal["decoder_linears", "all_linears"]
StatDtype = Literal["bf16", "fp16", "fp32"]  # storage of GradProbe's gradient statistics
EmbeddedCorpus = Literal["embedded", "stdlib"]  # data.source names of corpora shipped with Python (harness.data.documents)

PRECISIONS = get_args(Precision)
OPTIMIZER_NAMES = get_args(OptimName)
# The library each optimizer comes from, and which of them round the update into bf16 weights
# stochastically (the only ones that can train precision=bf16_pure: see harness.training.optim).
OPTIMIZER_LIBRARY = {
    "adamw": "torch",
    "adam": "torch",
    "sgd": "torch",
    "adamw_bf16": "torchao",
    "adamw_8bit": "torchao",
    "adamw_4bit": "torchao",
    "paged_adamw_8bit": "bitsandbytes",
}
BF16_WEIGHT_OPTIMIZERS = tuple(n for n in OPTIMIZER_NAMES if OPTIMIZER_LIBRARY[n] == "torchao")
AC_MODES = get_args(AcMode)
COMPILE_MODES = get_args(CompileMode)
LORA_QUANTIZE = get_args(LoraQuantize)
EMBEDDED_CORPORA = get_args(EmbeddedCorpus)
DATA_FORMATS = get_args(DataFormat)
INSTRUCTION_FORMATS = tuple(f for f in DATA_FORMATS if f != "text")  # blocks of (input_ids, labels)
PRUNE_METHODS = get_args(PruneMethod)
PRUNE_BASES = get_args(PruneBase)
PRUNE_DECISIONS = get_args(PruneDecision)
PRUNE_ALLOCATIONS = get_args(PruneAllocation)
PRUNE_SCOPES = get_args(PruneScope)
PRUNE_TARGETS = get_args(PruneTargets)
STAT_DTYPES = get_args(StatDtype)


def literal_choices(typ: Any) -> tuple[tuple[Any, ...], bool] | None:
    """(allowed values, whether None is allowed) of a `Literal` or `Literal | None` type; None otherwise."""
    if get_origin(typ) is Literal:
        return get_args(typ), False
    if get_origin(typ) in (Union, type(int | None)):
        inner = [a for a in get_args(typ) if a is not type(None)]
        if len(inner) == 1 and get_origin(inner[0]) is Literal:
            return get_args(inner[0]), True
    return None


def choice_fields(cls: type, prefix: str = "") -> dict[str, tuple[tuple[Any, ...], bool]]:
    """Every enumerated key of a config dataclass (dotted) -> (allowed values, None allowed)."""
    out: dict[str, tuple[tuple[Any, ...], bool]] = {}
    hints = get_type_hints(cls)
    for f in fields(cls):
        typ = hints[f.name]
        if is_dataclass(typ):
            out.update(choice_fields(typ, f"{prefix}{f.name}."))
        elif (choices := literal_choices(typ)) is not None:
            out[prefix + f.name] = choices
    return out


@dataclass
class ModelConfig:
    name: str = "tiny-llama"  # preset name, local path or hub id
    seed: int = 0  # random init seed for presets
    max_seq_len: int | None = None  # defaults to the model's max positions


@dataclass
class DataConfig:
    # "embedded" | "stdlib" (harness.data.documents), a hub dataset name, a local file/dir, or a flat token file (.npy/.bin)
    source: str = "embedded"
    text_field: str = "text"
    seq_len: int = 128
    eval_fraction: float = 0.05
    calib_fraction: float = 0.05
    max_tokens: int | None = None  # cap on the train split's tokens; None: the whole corpus
    tokenizer: str | None = None  # path; default: the model's, else a locally trained BPE
    vocab_size: int = 2048  # for the locally trained BPE tokenizer (and pre-tokenized input without one)
    seed: int = 1234
    cache_dir: str | None = None  # where tokenizers/tokenized data are cached
    num_proc: int | None = None  # tokenizer processes; None: the machine's cores (at most 16)
    streaming: bool = False  # read and tokenize on the fly, each rank its own part (corpora larger than the disk)
    eos_id: int | None = None  # document separator for pre-tokenized input without a tokenizer
    token_dtype: TokenDtype = "uint16"  # element type of a raw .bin token file
    stream_eval_blocks: int = 256  # streaming: eval and calib blocks read from the start of the stream
    format: DataFormat = "text"  # text (pretraining) | instruction | alpaca | sharegpt (JSON lines records, loss on the answers)
    packing: bool = True  # instruction: pack examples into full blocks (else one example per block, padded)
    block_bos: bool = True  # text: where the tokenizer puts a BOS before every text, every block starts with it


@dataclass
class OptimConfig:
    name: OptimName = "adamw"
    lr: float | None = None  # None: by what is trained (harness.config.schema.default_lr)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    schedule: Schedule = "cosine"
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    cpu_offload: bool = False  # torchao's CPUOffloadOptimizer: state and step on the host (CUDA only)


@dataclass
class MemoryConfig:
    """Memory techniques (`harness.memory`). All off by default."""

    activation_checkpointing: AcMode = "none"
    ac_every: int = 2  # selective: checkpoint every k-th block
    activation_offload: bool = False
    offload_checkpoint_inputs: bool = False  # only the inputs activation checkpointing keeps go to host memory (side stream, prefetch)
    compile: CompileMode = "none"
    activation_memory_budget: float | None = None  # in [0, 1]; implies compile
    optimizer_in_backward: bool = False
    loss_chunk_size: int = 0  # 0: plain fp32 cross-entropy; >0: chunked over the sequence
    tiled_mlp: int = 0  # >1: each block's MLP runs over this many sequence tiles, recomputed in backward (0: untiled)
    tiled_mlp_tokens: int = 0  # or tiles of this many tokens (the count follows the sequence); one of the two
    track: bool = True  # per-step peak memory: the platform's peak counters every step, the split by category on sampled steps
    track_every: int = 100  # split by category on steps 0, 1 and every k-th (0: 0 and 1 only); a split step costs ~2x on CPU
    snapshot: bool = False  # memory snapshot (GPU pickle / CPU per-module report)
    layer_hooks: bool = False  # per-block memory after forward (debug)


@dataclass
class ParallelConfig:
    """How the world's ranks split the work beyond data parallelism (`harness.engine`)."""

    # Ulysses sequence parallelism: each sample's sequence is split over this many ranks of the
    # world (a data x sequence mesh); attention swaps sequence shards for head shards and back.
    sequence: int = 1


@dataclass
class LoggingConfig:
    log_every: int = 1
    wandb: bool = True  # rank 0 only; offline without an API key
    wandb_project: str = "harness"
    run_name: str | None = None
    progress: bool = True
    plots: bool = True
    peak_flops: float | None = None  # per device, overrides the GPU table (needed for MFU on CPU)


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only at the end (if save_final)
    save_final: bool = False
    keep: int = 2
    resume: str = "none"  # none | auto | <path>
    overwrite: bool = False
    on_nonfinite: OnNonfinite = "skip"
    max_consecutive_skips: int = 10  # on_nonfinite=skip: this many skipped steps in a row stop the run (exit 3)
    export_hf: bool = False


@dataclass
class PruneConfig:
    method: PruneMethod = "none"
    base: PruneBase = "wanda"  # gradprobe's base score (candidates and order)
    sparsity: float = 0.5
    pattern: str = "unstructured"  # unstructured | N:M, e.g. 2:4
    calib_samples: int = 16
    calib_seed: int = 0
    group_size: int = 0  # K decoder blocks probed together; 0 = chosen from memory (decision=original: one matrix)
    threshold: float = 0.0
    reduction: float = 0.1
    # The next four: None = the decision mode's default (harness/config/prune_modes.py): rank/veto
    # exact, per_matrix, bf16, sequential for SparseGPT only; original: veto, global (magnitude base), fp32, sequential.
    exact_target: bool | None = None
    # gradprobe: one of PRUNE_DECISIONS (harness/pruning/gradprobe.py). veto is the default because
    # it is the decision that costs least against its Wanda base on the pruning benchmark
    # (notes/pruning.md); rank and saliency are measured there to do worse.
    decision: PruneDecision = "veto"
    scope: PruneScope | None = None
    targets: PruneTargets = "decoder_linears"
    pool: float = 0.25  # exact-target GradProbe: probe (1 + pool) x target candidates
    sequential: bool | None = None  # apply each group's mask before probing the next
    schedule: list[float] | None = None  # iterative targets, e.g. [0.3, 0.4, 0.5]
    max_metric_increase: float = 0.1  # iterative schedule stops when eval loss rises more than this
    stat_dtype: StatDtype | None = None  # storage of gradient statistics
    finetune_steps: int = 0  # training steps after pruning (masks enforced)
    allocation: PruneAllocation = "uniform"  # per-block sparsity; owl: outlier-weighted (harness/pruning/experimental/owl.py)
    owl_lambda: float = 0.08  # OWL: block sparsities span target +- lambda
    owl_m: float = 5.0  # OWL: an outlier is a Wanda score above m x its block's mean
    # decision=reconstruct: Adam epochs over the calibration set per block, and their step size
    recon_steps: int = 4
    recon_lr: float = 1e-4


@dataclass
class LoraConfig:
    """LoRA/QLoRA fine-tuning (`harness.models.lora`, built on `peft`): the base is frozen, the
    adapters train, so gradients and optimizer state exist for the adapters only."""

    enabled: bool = False
    r: int = 8  # adapter rank
    alpha: float = 16.0  # scaling alpha / r
    dropout: float = 0.0  # on the adapter input
    target_modules: list[str] | None = None  # module names; None: every linear layer inside the decoder blocks
    quantize: LoraQuantize = "none"  # int8 | nf4: QLoRA (the base quantized by bitsandbytes; nf4 also under FSDP2)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    strategy: str | None = None  # a name in ds_configs/ or a JSON path; None: from the launcher, else ddp
    precision: Precision = "fp32"
    micro_batch_size: int = 4
    grad_accum: int = 1
    global_batch_size: int | None = None  # if set: must equal micro * accum * world
    steps: int = 50
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    seed: int = 0
    output_dir: str = "runs/default"
    device: Device = "auto"
    # The dotted keys the user wrote, set by `load_config` (a ClassVar, so not a config key); see `is_given`.
    given_keys: ClassVar[frozenset[str] | None] = None

    def __post_init__(self) -> None:
        if self.optim.lr is None:  # not given: the default for what this run trains
            self.optim.lr = default_lr(self)[0]


def is_given(cfg: RunConfig, key: str) -> bool:
    """Whether the user wrote dotted `key` (in the config file or a `key=value` override).

    A value the user did not write is a default, which a setting from outside the run config
    (a DeepSpeed file's own number, an `accelerate launch` flag) may replace; a written one it
    may only contradict. `load_config` records the written keys; a RunConfig built in code
    records none, and then every key counts as written (contradictions are named, nothing is
    replaced silently)."""
    given = getattr(cfg, "given_keys", None)
    return True if given is None else key in given


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
