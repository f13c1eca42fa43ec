"""LoRA and QLoRA with `peft`: adapters on a frozen base (quantized by bitsandbytes for QLoRA).

The adapters are injected into the HF model *in place* (`peft.get_peft_model` keeps the
original module as `base_model.model`), and the engines train that HF module: FSDP2 finds
its decoder blocks, the chunked loss finds its head, and checkpoints key parameters by the
same names as any other run (`...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`).
The `PeftModel` around it is rebuilt when it is needed, by export (`save_pretrained` of the
adapter directory, `merge_and_unload` for a merged model).

Only what requires gradients is trained, so gradients and optimizer state exist for the
adapters alone; the engines already build their optimizers from trainable parameters.

QLoRA (`lora.quantize: int8 | nf4`): the base's linears are bitsandbytes' quantized ones,
built on the meta device and quantized a tensor at a time (`harness.models.qlora`); peft
wraps them with its bitsandbytes LoRA layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.config import LoraConfig, RunConfig
from harness.errors import ConfigError
from harness.log import get_logger
from harness.models.blocks import decoder_blocks
from harness.models.build import ModelSpec, build_spec_model, count_parameters, model_spec
from harness.models.experts import stacked_expert_weights
from harness.models.weights import clean_name, module_seed, strip_base_layer

log = get_logger(__name__)


def default_target_modules(model: nn.Module) -> list[str]:
    """Every linear layer inside the decoder blocks, by its attribute name (QLoRA's "all linear
    layers" choice: attention and MLP projections; embeddings and the LM head stay frozen).
    Found on the model itself, so it is right for any architecture whose blocks we can find."""
    names = {
        name.rsplit(".", 1)[-1]
        for block in decoder_blocks(model)
        for name, mod in block.named_modules()
        if isinstance(mod, nn.Linear) or type(mod).__name__ in ("Linear8bitLt", "Linear4bit")
    }
    if not names:
        raise ConfigError(f"{type(model).__name__}: no linear layers in its decoder blocks to adapt; set lora.target_modules")
    return sorted(names)


def stacked_expert_parameters(model: nn.Module) -> list[str]:
    """`<module>.<parameter>` of every stacked expert weight in the decoder blocks
    (`experts.stacked_expert_weights`). peft adapts such a tensor with one rank-r pair per expert
    (`target_parameters`, its `ParamWrapper`); no linear-layer name reaches it. Expert biases stay
    frozen, as a linear's bias does."""
    return sorted(
        {
            f"{strip_base_layer(module_name).rsplit('.', 1)[-1]}.{attr}"
            for block in decoder_blocks(model)
            for module_name, _, attr in stacked_expert_weights(block)
        }
    )


@dataclass(frozen=True)
class AdapterTargets:
    """What a run's adapters reach: linear layers by attribute name (`target_modules`) and
    stacked expert tensors by `<module>.<parameter>` (`target_parameters`)."""

    modules: list[str]
    parameters: list[str]


def resolve_targets(model: nn.Module, cfg: LoraConfig, quiet: bool = False) -> AdapterTargets:
    """The user's `lora.target_modules` and `lora.target_parameters` (each must name something of
    this model), each unset one filled from the model and logged (`quiet`: not logged). Refuses
    what peft or bitsandbytes would reject or silently leave out on a mixture of experts."""
    experts = stacked_expert_parameters(model)
    name = type(model).__name__
    if cfg.quantize != "none" and experts:
        raise ConfigError(
            f"lora.quantize={cfg.quantize}: bitsandbytes quantizes linear layers only, and {name}'s experts are stacked "
            f"tensors ({', '.join(experts)}) it would leave unquantized, most of the base; set lora.quantize=none "
            "(a bf16 base sharded by FSDP2 holds the experts in 2 bytes each)"
        )
    modules = resolve_target_modules(model, cfg, quiet)
    if cfg.target_parameters is None:
        parameters = experts
        if parameters and not quiet:
            log.info(f"lora.target_parameters: unset, filled with the blocks' stacked experts: {parameters} (an adapter per expert)")
    else:
        parameters = list(cfg.target_parameters)
        held = {
            f"{strip_base_layer(module_name)}.{param_name}"
            for module_name, module in model.named_modules()
            for param_name, _ in module.named_parameters(recurse=False)
        }
        missing = [t for t in parameters if not any(h == t or h.endswith(f".{t}") for h in held)]  # peft's match
        if missing:
            raise ConfigError(
                f"lora.target_parameters names {missing} which {name} does not have; its stacked experts are {experts or 'none'}"
            )
    if parameters and cfg.dropout:
        raise ConfigError(
            f"lora.dropout={cfg.dropout:g} cannot apply to stacked experts {parameters}: peft adapts a tensor, not a layer's "
            "input (its ParamWrapper has no dropout); set lora.dropout=0, or lora.target_parameters=[] to leave the experts frozen"
        )
    return AdapterTargets(modules, parameters)


def resolve_target_modules(model: nn.Module, cfg: LoraConfig, quiet: bool = False) -> list[str]:
    """The user's `lora.target_modules` (each must name a module of this model), or the default, logged."""
    if cfg.target_modules is None:
        targets = default_target_modules(model)
        if not quiet:
            log.info(f"lora.target_modules: unset, filled with every linear layer of the decoder blocks: {targets}")
        return targets
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in cfg.target_modules if t not in present]
    if missing:
        available = default_target_modules(model)
        raise ConfigError(
            f"lora.target_modules names {missing} which {type(model).__name__} does not have; its decoder linears are {available}"
        )
    return list(cfg.target_modules)


def peft_config(cfg: LoraConfig, targets: AdapterTargets) -> Any:
    """The `peft.LoraConfig` of a run (the same one training and export use)."""
    import peft

    return peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets.modules,
        target_parameters=targets.parameters or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap_peft(model: nn.Module, cfg: LoraConfig, targets: AdapterTargets, seed: int) -> Any:
    """`model` with adapters injected in place, as a `PeftModel`. The adapters' random init
    (lora_A; lora_B starts at zero) is seeded, so every rank and every launcher gets the same."""
    import peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, peft_config(cfg, targets))


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int) -> nn.Module:
    """Freeze the base and inject adapters; returns the HF module the engines train (the same object)."""
    targets = resolve_targets(model, cfg)
    inner = wrap_peft(model, cfg, targets, seed).base_model.model
    _log_adapters(inner, cfg, targets)
    return inner


def _log_adapters(inner: nn.Module, cfg: LoraConfig, targets: AdapterTargets) -> None:
    trainable, total = trainable_counts(inner)
    reached = targets.modules + [f"{p} (per expert)" for p in targets.parameters]
    log.info(
        f"LoRA r={cfg.r} alpha={cfg.alpha:g} on {reached}: {trainable:,} trainable of {total:,} parameters "
        f"({100.0 * trainable / max(total, 1):.2f}%), base frozen{'' if cfg.quantize == 'none' else ', ' + cfg.quantize}"
    )


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter elements (a quantized weight counted as the weights it encodes)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad), count_parameters(model)


def empty_lora_model(template: nn.Module, cfg: LoraConfig, quiet: bool = False) -> nn.Module:
    """`template` (a model on the meta device) with adapters injected, still on the meta device
    (peft's `low_cpu_mem_usage`): sharded and filled like any model, so no rank ever holds the
    whole base. Returns the HF module the engines train; fill it from `LoraWeights`. `quiet`: no
    log line (the planner builds it to trace, not to train)."""
    import peft

    targets = resolve_targets(template, cfg, quiet)
    inner = peft.get_peft_model(template, peft_config(cfg, targets), low_cpu_mem_usage=True).base_model.model
    if not quiet:
        _log_adapters(inner, cfg, targets)
    return inner


class LoraWeights:
    """The weights of a LoRA model built on the meta device: the base's from `base` (a
    `WeightSource` of the model without adapters: peft's `.base_layer` segment dropped), the
    adapters' from peft's own init rule (lora_A Kaiming-uniform with a = sqrt(5), lora_B zero)
    under a seed of each adapter's own, so every rank and world size starts from the same."""

    ADAPTER = ".lora_"

    def __init__(self, base: Any, seed: int):
        self.base, self.seed = base, seed

    def read(self, names: Any, shape: Any, start: int, end: int) -> torch.Tensor | None:
        if self.ADAPTER not in names[0]:
            return self.base.read([strip_base_layer(n) for n in names], shape, start, end)
        full = torch.zeros(tuple(shape), dtype=torch.float32)
        if ".lora_A." in names[0]:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(self.seed, names[0]))
                nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        return full.reshape(-1)[start:end]


def build_run_model(cfg: RunConfig, vocab_size: int, dtype: torch.dtype = torch.float32, spec: ModelSpec | None = None) -> nn.Module:
    """The model a run trains, built whole in one process: the preset or pretrained model (its
    linears quantized for QLoRA, computing in fp32), with LoRA adapters on a frozen base when
    `lora.enabled` (DeepSpeed's LoRA path at ZeRO-0/1/2, and the tests' world-1 reference; the torch engines
    build on the meta device instead). Resume rebuilds the same base, which is why a LoRA
    checkpoint needs only the adapters. `dtype`: what the model is built in, a quantized base's
    codes stored in it (the same codes in any dtype: they are quantized from fp32)."""
    if spec is None:  # `spec`: the engine's, which may be a twin of the named model (`twin_spec`)
        spec = model_spec(cfg.model.name, vocab_size=vocab_size, seed=cfg.model.seed)
    model = build_spec_model(spec, dtype=dtype, quantize=cfg.lora.quantize)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora, seed=cfg.model.seed)
        init_adapters(model, cfg.model.seed)
    return model


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """The adapters of a built LoRA model set by `LoraWeights`' rule: the same start as a model
    built on the meta device and filled, whichever way a run builds it."""
    rule = LoraWeights(None, seed)
    for name, p in model.named_parameters():
        if LoraWeights.ADAPTER in name:
            p.copy_(rule.read([clean_name(name)], tuple(p.shape), 0, p.numel()).view(p.shape).to(p.dtype))


__all__ = [
    "AdapterTargets",
    "LoraWeights",
    "apply_lora",
    "empty_lora_model",
    "init_adapters",
    "build_run_model",
    "default_target_modules",
    "peft_config",
    "resolve_target_modules",
    "resolve_targets",
    "stacked_expert_parameters",
    "trainable_counts",
    "wrap_peft",
]
