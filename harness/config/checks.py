"""Every rule a run config must satisfy, in one place.

Rules that need only the config (and, where said, the world size or whether an accelerator
exists) live here; `harness.runner.preflight` runs them together with the checks that
look at the outside world (model and data files, the output directory, checkpoints).
"""

from __future__ import annotations

import functools
import importlib.util
import math

from harness.config.layout import ParallelLayout
from harness.config.prune_methods import needs_calibration
from harness.config.prune_modes import check_prune_mode
from harness.config.schema import RENAMED, LoraConfig, MemoryConfig, MoeConfig, OptimConfig, RunConfig
from harness.config.sequence_checks import check_sequence_engine, check_sequence_parallel
from harness.config.strategies import Strategy
from harness.config.vocabulary import BF16_WEIGHT_OPTIMIZERS, EMBEDDED_CORPORA, INSTRUCTION_FORMATS, OPTIMIZER_LIBRARY, choice_fields
from harness.errors import ConfigError, did_you_mean

# Sections whose keys do nothing until one key switches them on: the switch and how to turn it on.
SWITCHED_SECTIONS = {
    "lora": (("enabled",), "lora.enabled=true"),
    "prune": (("method", "experts"), "prune.method=<{}> or prune.experts=<fraction of each MoE layer's experts>"),
}


def check_dead_keys(given: dict, cfg: RunConfig) -> None:
    """A key of a switched-off section whose switch the user never gave does nothing: `lora.r=8`
    without `lora.enabled=true` would silently train the whole model. Name the switch.
    A switch given explicitly off (`lora.enabled: false`) is the user's choice, not an error."""
    for section, (switches, turn_on) in SWITCHED_SECTIONS.items():
        keys = given.get(section)
        if not isinstance(keys, dict) or any(s in keys for s in switches):
            continue
        switch = switches[0]
        dead = sorted(k for k in keys if k not in switches)
        if dead:
            if "{}" in turn_on:  # an enumerated switch: its values other than "off"
                choices = choice_fields(RunConfig)[f"{section}.{switch}"][0]
                turn_on = turn_on.format("|".join(c for c in choices if c != getattr(getattr(cfg, section), switch)))
            names = ", ".join(f"{section}.{k}" for k in dead)
            raise ConfigError(f"{names} set but {section}.{switch} is not: set {turn_on} (or remove {names}); it does nothing otherwise")


def check_values(cfg: RunConfig) -> None:
    """Checks on single values; cross-checks that need the strategy or model live elsewhere."""
    for key, (allowed, none_ok) in choice_fields(RunConfig).items():  # every Literal-typed key (schema.py)
        value = functools.reduce(getattr, key.split("."), cfg)
        if value is None and none_ok:  # None: the default of the decision mode (prune_modes) or of the engine
            continue
        if f"{key}={value}" in RENAMED:
            raise ConfigError(f"{key}={value} is now {RENAMED[f'{key}={value}']}")
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}{did_you_mean(str(value), list(allowed))}")
    positive = {
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum": cfg.grad_accum,
        "steps": cfg.steps,
        "data.seq_len": cfg.data.seq_len,
        "eval_batches": cfg.eval_batches,
        "parallel.sequence": cfg.parallel.sequence,
        "parallel.expert": cfg.parallel.expert,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    check_optimizer_values(cfg.optim)
    at_least = {
        "memory.ac_every": (cfg.memory.ac_every, 1),
        "memory.track_every": (cfg.memory.track_every, 0),
        "logging.log_every": (cfg.logging.log_every, 1),
        "memory.loss_chunk_size": (cfg.memory.loss_chunk_size, 0),
        "memory.tiled_mlp": (cfg.memory.tiled_mlp, 0),
        "memory.tiled_mlp_tokens": (cfg.memory.tiled_mlp_tokens, 0),
        "eval_every": (cfg.eval_every, 0),
    }
    for key, (value, low) in at_least.items():
        if value < low:
            raise ConfigError(f"{key}={value} must be >= {low}")
    if cfg.memory.tiled_mlp and cfg.memory.tiled_mlp_tokens:
        raise ConfigError(
            f"memory.tiled_mlp={cfg.memory.tiled_mlp} and memory.tiled_mlp_tokens={cfg.memory.tiled_mlp_tokens}: "
            "give the MLP's tile count or its tile size, not both"
        )
    if cfg.memory.offload_checkpoint_inputs:
        why = (
            "there are none without memory.activation_checkpointing"
            if cfg.memory.activation_checkpointing == "none"
            else "memory.activation_offload=true already offloads every saved tensor, these included"
            if cfg.memory.activation_offload
            else "not supported with torch.compile (saved-tensor hooks in compiled blocks, untested); set memory.compile=none"
            if cfg.memory.compile != "none" or cfg.memory.activation_memory_budget is not None
            else None
        )
        if why:
            raise ConfigError(f"memory.offload_checkpoint_inputs=true: {why}")
    budget = cfg.memory.activation_memory_budget
    if budget is not None and not 0.0 <= budget <= 1.0:
        raise ConfigError(f"memory.activation_memory_budget={budget} must be in [0, 1]")
    if not 0.0 <= cfg.prune.sparsity < 1.0:
        raise ConfigError(f"prune.sparsity={cfg.prune.sparsity} must be in [0, 1)")
    if not 0.0 <= cfg.prune.experts < 1.0:
        raise ConfigError(f"prune.experts={cfg.prune.experts} (the fraction of each MoE layer's experts to drop) must be in [0, 1)")
    if cfg.prune.pattern != "unstructured":
        try:
            n, m = (int(x) for x in cfg.prune.pattern.split(":"))
        except ValueError:
            raise ConfigError(f"prune.pattern={cfg.prune.pattern!r} must be 'unstructured' or N:M like 2:4") from None
        if not 0 < n < m:
            raise ConfigError(f"prune.pattern={cfg.prune.pattern}: N:M needs 0 < N < M")
        if cfg.prune.prunes_weights and abs(cfg.prune.sparsity - (m - n) / m) > 1e-9:
            raise ConfigError(
                f"prune.pattern={cfg.prune.pattern} prunes {(m - n) / m:g} of each group "
                f"but prune.sparsity={cfg.prune.sparsity}; set prune.sparsity={(m - n) / m:g}"
            )
    if cfg.data.max_tokens is not None and cfg.data.max_tokens < cfg.data.seq_len:
        raise ConfigError(
            f"data.max_tokens={cfg.data.max_tokens} is less than one block of data.seq_len={cfg.data.seq_len}; "
            "raise it or leave it unset (the whole corpus)"
        )
    if cfg.data.streaming and cfg.data.max_tokens is not None:
        raise ConfigError(
            "data.max_tokens caps the prepared cache; with data.streaming=true the steps decide how much is read (unset data.max_tokens)"
        )
    if cfg.data.num_proc is not None and cfg.data.num_proc < 1:
        raise ConfigError(f"data.num_proc={cfg.data.num_proc} must be >= 1 (or unset: the machine's cores)")
    check_lora_values(cfg.lora)
    aux_loss_coefficient(cfg.moe)
    if cfg.data.format in INSTRUCTION_FORMATS and (cfg.data.source in EMBEDDED_CORPORA or cfg.data.streaming):
        raise ConfigError(
            f"data.format={cfg.data.format} reads a local JSON lines file of prompt/response, messages, Alpaca or ShareGPT records "
            f"(data.source={cfg.data.source!r}{', streaming' if cfg.data.streaming else ''}); "
            "set data.source to it and data.streaming=false"
        )
    if not 0.0 < cfg.data.eval_fraction < 0.5:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction} must be in (0, 0.5)")
    if not 0.0 <= cfg.data.calib_fraction < 0.5:
        raise ConfigError(f"data.calib_fraction={cfg.data.calib_fraction} must be in [0, 0.5) (0: no calibration split)")
    if cfg.data.calib_fraction == 0.0 and needs_calibration(cfg.prune):
        raise ConfigError(
            f"{cfg.prune.named} calibrates on the calib split, but data.calib_fraction=0 holds out none; "
            "set data.calib_fraction (default 0.05)"
        )


def aux_loss_coefficient(moe: MoeConfig) -> float | None:
    """`moe.aux_loss_coef` read: None for auto (the model config's), else the coefficient (0: off)."""
    text = str(moe.aux_loss_coef).strip().lower()
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(
            f"moe.aux_loss_coef={moe.aux_loss_coef!r} must be auto (the model config's router_aux_loss_coef), 0 (off) or a number > 0"
        )
    return value


def check_lora_values(lo: LoraConfig) -> None:
    """LoRA values peft would reject later (or misuse silently), refused on load."""
    if lo.r < 1:
        raise ConfigError(f"lora.r={lo.r} must be >= 1")
    if not lo.alpha > 0:
        raise ConfigError(f"lora.alpha={lo.alpha} must be > 0")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout={lo.dropout} must be in [0, 1)")
    if lo.target_modules is not None and not lo.target_modules:
        raise ConfigError("lora.target_modules=[] selects nothing to train; name modules (e.g. [q_proj, v_proj]) or leave it unset")
    if lo.quantize != "none" and not lo.enabled:
        raise ConfigError(f"lora.quantize={lo.quantize} quantizes a frozen base for QLoRA; set lora.enabled=true as well")


def check_lora(cfg: RunConfig, strategy_kind: str, zero_stage: int = 0) -> None:
    """What LoRA/QLoRA can run with, decided before any process group starts."""
    lo = cfg.lora
    if cfg.data.format in INSTRUCTION_FORMATS and cfg.prune.enabled:
        raise ConfigError(
            f"data.format={cfg.data.format} cannot calibrate pruning (its blocks carry labels); prune on text data, "
            "export, then fine-tune the pruned model"
        )
    if not lo.enabled:
        return
    if cfg.prune.enabled:
        raise ConfigError(
            f"lora.enabled=true with {cfg.prune.named}: prune first (harness.prune), export the "
            "pruned model, then fine-tune it with LoRA (see notes/lora.md)"
        )
    if cfg.memory.optimizer_in_backward:
        raise ConfigError(
            "lora.enabled=true with memory.optimizer_in_backward=true: the adapters' optimizer state is already "
            "small; turn optimizer_in_backward off"
        )
    if lo.quantize == "none":
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"lora.quantize={lo.quantize} needs the bitsandbytes package: pip install bitsandbytes (a dependency of harness)")
    if strategy_kind == "deepspeed" and (lo.quantize != "nf4" or zero_stage != 3):
        raise ConfigError(
            f"lora.quantize={lo.quantize} under DeepSpeed ZeRO-{zero_stage}: only nf4 under ZeRO-3 (its 4-bit codes stored "
            "in DeepSpeed's working dtype, partitioned like any weight) runs here; use strategy=zero3 with lora.quantize=nf4, "
            "strategy=fsdp, or ddp"
        )
    if lo.quantize == "int8" and strategy_kind == "fsdp":
        raise ConfigError(
            "lora.quantize=int8 cannot be sharded by FSDP2 (LLM.int8's row scales live beside the weight, not in it); "
            "use lora.quantize=nf4 under fsdp, or int8 under ddp"
        )


def check_optimizer_in_backward_engine(memory: MemoryConfig, strategy_kind: str, strategy_name: str = "") -> None:
    """The optimizer-in-backward/DeepSpeed rule, defined once: DeepSpeed owns the optimizer step."""
    if memory.optimizer_in_backward and strategy_kind == "deepspeed":
        named = f" ({strategy_name})" if strategy_name else ""
        raise ConfigError(
            f"memory.optimizer_in_backward=true cannot run under DeepSpeed{named}: DeepSpeed owns the optimizer "
            "step; use ddp/fsdp strategies or turn it off"
        )


def check_optimizer_in_backward(cfg: RunConfig, strategy_kind: str, world_size: int) -> None:
    """Raise ConfigError (one line) when optimizer-in-backward cannot work with this run config."""
    if not cfg.memory.optimizer_in_backward:
        return
    if cfg.optim.grad_clip > 0:
        raise ConfigError(
            f"memory.optimizer_in_backward=true needs optim.grad_clip=0 (got {cfg.optim.grad_clip}): each parameter "
            "steps as soon as its gradient is ready, before the global gradient norm exists"
        )
    if cfg.precision == "fp16":
        raise ConfigError(
            "memory.optimizer_in_backward=true cannot run with precision=fp16: the loss scaler must check every "
            "gradient for inf/nan before any parameter steps; use bf16 or fp32"
        )
    check_optimizer_in_backward_engine(cfg.memory, strategy_kind)
    if strategy_kind == "ddp" and world_size > 1:
        raise ConfigError(
            "memory.optimizer_in_backward=true cannot run with DDP at world>1: the per-parameter hooks fire before "
            "DDP all-reduces the gradient buckets; use an fsdp strategy"
        )


def check_prune_config(cfg: RunConfig, world: int) -> None:
    """What can be checked before any process starts: the calibration set must fill one probe
    step (every rank runs `grad_accum` micro-batches per probe step)."""
    p = cfg.prune
    if not p.enabled:
        return
    per_step = cfg.micro_batch_size * cfg.grad_accum * world
    if needs_calibration(p) and p.calib_samples < per_step:
        raise ConfigError(
            f"prune.calib_samples={p.calib_samples} cannot fill one probe step of micro_batch_size*grad_accum*world "
            f"({cfg.micro_batch_size}*{cfg.grad_accum}*{world}={per_step}); raise it to a multiple of {per_step}"
        )
    if p.schedule is not None and p.pattern != "unstructured":
        raise ConfigError(f"prune.schedule raises an unstructured target; prune.pattern={p.pattern} fixes the sparsity")
    if p.finetune_steps < 0:
        raise ConfigError(f"prune.finetune_steps={p.finetune_steps} must be >= 0")
    if p.experts and p.finetune_steps:
        raise ConfigError(
            f"prune.experts={p.experts:g} with prune.finetune_steps={p.finetune_steps}: the dropped experts leave only at the "
            "export; fine-tune the exported model (smaller, so faster): unset prune.finetune_steps, then "
            "python -m harness.train model.name=<output_dir>/hf"
        )
    check_prune_mode(p)


def check_strategy_against_run(strategy: Strategy, cfg: RunConfig, has_accelerator: bool) -> None:
    """Cross-checks between a strategy and the run config, before any process group starts."""
    check_optimizer_in_backward_engine(cfg.memory, strategy.kind, strategy.name)
    check_optimizer_engine(cfg, strategy.kind, strategy.name, has_accelerator)
    check_sequence_engine(cfg, strategy)
    if cfg.precision == "fp16" and strategy.kind == "fsdp" and not has_accelerator:
        raise ConfigError("precision=fp16 with FSDP2 needs a GPU (its gradient scaler is CUDA-only); use bf16 or fp32 on CPU")


def check_optimizer_engine(cfg: RunConfig, strategy_kind: str, strategy_name: str, has_accelerator: bool) -> None:
    """The optimizer and precision rules that depend on the engine, each refused in one line."""
    name, named = cfg.optim.name, f" ({strategy_name})" if strategy_name else ""
    if cfg.precision == "bf16_pure" and name not in BF16_WEIGHT_OPTIMIZERS:
        raise ConfigError(
            f"precision=bf16_pure with optim.name={name}: without an fp32 master, an update smaller than half a bf16 step "
            f"of its weight rounds away (most of them, late in training); use optim.name={'|'.join(BF16_WEIGHT_OPTIMIZERS)} "
            "(torchao: stochastic rounding), or precision=bf16 (fp32 master)"
        )
    if strategy_kind == "deepspeed":
        if cfg.precision == "bf16_pure":
            raise ConfigError(
                f"precision=bf16_pure cannot run under DeepSpeed{named}: its bf16 mode always keeps fp32 master "
                "partitions; use precision=bf16 there, or an fsdp/ddp strategy for bf16 weights without a master"
            )
        if OPTIMIZER_LIBRARY[name] != "torch":
            raise ConfigError(
                f"optim.name={name} cannot run under DeepSpeed{named}: ZeRO steps its own flat fp32 partitions with its "
                "own optimizers (Adam, AdamW, SGD, ... in its config), which have no 8-bit/4-bit/bf16 states; use an "
                "fsdp or ddp strategy, or optim.name=adamw"
            )
        if cfg.optim.cpu_offload:
            raise ConfigError(
                f"optim.cpu_offload=true is torchao's offload for torch engines; under DeepSpeed{named} use its own "
                "offload_optimizer (zero2_offload.json, zero3_offload.json)"
            )
    if cfg.precision == "bf16_pure" and strategy_kind == "fsdp" and name in ("adamw_8bit", "adamw_4bit"):
        raise ConfigError(
            f"precision=bf16_pure with optim.name={name} cannot run under FSDP2{named}: torchao's quantized state over bf16 "
            "DTensor shards fails in its step (eager and compiled, torch 2.13); use optim.name=adamw_bf16 under FSDP2, "
            f"or {name} with precision=bf16 (fp32 shards) or under ddp"
        )
    if name == "paged_adamw_8bit" and strategy_kind == "fsdp":
        raise ConfigError(
            f"optim.name=paged_adamw_8bit cannot run under FSDP2{named}: bitsandbytes' 8-bit step takes plain tensors, "
            "not FSDP2's DTensor shards; use optim.name=adamw_8bit (torchao, shards its state with FSDP2)"
        )
    if cfg.optim.cpu_offload:
        if not has_accelerator:
            raise ConfigError(
                "optim.cpu_offload=true needs a CUDA GPU (torchao's CPUOffloadOptimizer moves state and gradients "
                "between the GPU and the host); on a CPU-only machine the state is in host memory already: turn it off"
            )
        if strategy_kind == "fsdp" or name == "paged_adamw_8bit" or cfg.memory.optimizer_in_backward:
            why = "FSDP2" if strategy_kind == "fsdp" else "memory.optimizer_in_backward"
            why = f"optim.name={name}" if name == "paged_adamw_8bit" else why
            raise ConfigError(
                f"optim.cpu_offload=true cannot run with {why}: torchao's CPUOffloadOptimizer is for one GPU's whole "
                "parameters stepped after backward; use fsdp_offload.json (FSDP2) or turn one of them off"
            )


def check_cpu_offload_world(optim: OptimConfig, strategy_kind: str, world: int) -> None:
    """torchao's CPUOffloadOptimizer is written for one GPU (its state dict is its own, per process)."""
    if optim.cpu_offload and world > 1:
        raise ConfigError(
            f"optim.cpu_offload=true runs on one GPU (torchao's CPUOffloadOptimizer), not {strategy_kind} x{world}; "
            "use fsdp_offload.json or zero2_offload.json for several"
        )


def check_batch(cfg: RunConfig, world: int) -> None:
    gbs = cfg.global_batch_size
    if gbs is None:
        return
    per_step = cfg.micro_batch_size * world
    if gbs % per_step:
        raise ConfigError(
            f"global_batch_size={gbs} is not divisible by micro_batch_size*world "
            f"({cfg.micro_batch_size}*{world}={per_step}); "
            "choose a multiple of it"
        )
    if gbs != per_step * cfg.grad_accum:
        raise ConfigError(
            f"global_batch_size={gbs} != micro_batch_size*grad_accum*world ({cfg.micro_batch_size}*{cfg.grad_accum}*{world}="
            f"{per_step * cfg.grad_accum}); set grad_accum={gbs // per_step}"
        )


def check_run(cfg: RunConfig, strategy: Strategy, world: int, has_accelerator: bool) -> None:
    """Every config-only rule for this strategy at this world size (values were checked on load)."""
    check_strategy_against_run(strategy, cfg, has_accelerator)
    check_optimizer_in_backward(cfg, strategy.kind, world)
    check_cpu_offload_world(cfg.optim, strategy.kind, world)
    check_sequence_parallel(cfg, strategy, world)
    check_expert_parallel(cfg, strategy, world)
    check_batch(cfg, ParallelLayout.of(cfg.parallel, world).data)
    check_prune_config(cfg, world)
    check_lora(cfg, strategy.kind, strategy.zero_stage)
    # A DeepSpeed file's contradictions and 'auto' holes are refused where its dict is resolved, once:
    # `harness.engine.plan_engine`, called by pre-flight.


def check_expert_parallel(cfg: RunConfig, strategy: Strategy, world: int) -> None:
    """What expert parallelism (`parallel.expert`) runs with; the model's experts are checked where
    its config is read (pre-flight's `check_experts`)."""
    n = cfg.parallel.expert
    if n == 1:
        return
    ParallelLayout.of(cfg.parallel, world)  # divides the world
    what = f"parallel.expert={n}"
    refused = {
        f"strategy={strategy.name} ({strategy.kind})": strategy.kind not in ("ddp", "fsdp"),  # DeepSpeed's AutoEP: not wired
        f"{cfg.prune.named}": cfg.prune.enabled,
        "lora.enabled": cfg.lora.enabled or cfg.lora.quantize != "none",
        "memory.optimizer_in_backward": cfg.memory.optimizer_in_backward,
        "precision=fp16": cfg.precision == "fp16",
        f"optim.name={cfg.optim.name}": cfg.optim.name not in ("adamw", "adam", "sgd"),
        "optim.cpu_offload": cfg.optim.cpu_offload,
    }
    for setting, on in refused.items():
        if on:
            raise ConfigError(
                f"{what} with {setting}: expert parallelism runs under strategy=ddp or fsdp with torch's adamw, adam or sgd, "
                "without pruning, LoRA, optimizer-in-backward, an offloaded optimizer or fp16; set parallel.expert=1 or change that setting"
            )


def check_optimizer_values(o: OptimConfig) -> None:
    """The values torch's optimizers and schedules would reject (or silently misuse), refused
    before launch instead of as a traceback after the model is built."""
    if not o.lr > 0:
        raise ConfigError(f"optim.lr={o.lr} must be > 0")
    if o.eps < 0 or o.weight_decay < 0 or o.grad_clip < 0:
        key, value = next(
            (k, v) for k, v in (("optim.eps", o.eps), ("optim.weight_decay", o.weight_decay), ("optim.grad_clip", o.grad_clip)) if v < 0
        )
        raise ConfigError(f"{key}={value} must be >= 0")
    if not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)} must each be in [0, 1)")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
