"""The choices of the config's enumerated keys, one definition each.

A `Literal` type is the field's type, and the tuple of its values (`get_args`) is what the checks
and the techniques read, so a new choice is added in one place and is checked everywhere. The
schema (`harness.config.schema`) types its fields with these.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

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
# sparsegpt_fit: SparseGPT block by block, each block's surviving weights then fitted to the dense block's outputs
# by gradient steps, guarded (harness.pruning.fit)
PruneMethod = Literal["none", "magnitude", "wanda", "sparsegpt", "sparsegpt_fit", "gradprobe"]
# GradProbe's base scores: magnitude, wanda in harness.pruning.methods; gblm, taylor, ria (measured worse) in harness.pruning.experimental
# How expert pruning (prune.experts) scores each expert on the calibration set (harness.pruning.experts)
ExpertScore = Literal["gradient", "reap", "frequency", "random"]
PruneBase = Literal["magnitude", "wanda", "gblm", "taylor", "ria"]
# GradProbe's decision rule (harness/config/prune_modes.py); rank and saliency (measured worse): harness.pruning.experimental
PruneDecision = Literal["rank", "veto", "saliency", "original"]
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
EXPERT_SCORES = get_args(ExpertScore)
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
