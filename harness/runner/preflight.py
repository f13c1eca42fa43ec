"""Pre-flight validation: every check that can fail before a process group starts.

Each failure is a ConfigError with one actionable line; `harness.train` prints it and
exits non-zero, so nothing is launched, nothing is written and nothing of the user's is
touched. A mistake found here costs seconds; the same mistake found after the launcher
has queued 64 GPUs and the model is loaded costs an hour (or, for the output-directory
rule, a previous run's checkpoints).

The rules on the config itself live in `harness.config.checks` (run here through
`check_run`, once); this module adds what needs the outside world: the launcher's
environment, the model's files and shape, the data files, the output directory and an
existing checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
import transformers
from huggingface_hub import try_to_load_from_cache
from safetensors import safe_open
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from harness.checkpoint import (
    adapter_dir,
    check_compatible,
    checkpoint_root,
    export_target_refusal,
    later_checkpoints,
    resume_path,
    verified_meta,
)
from harness.config import (
    ParallelLayout,
    RunConfig,
    Strategy,
    aux_loss_coefficient,
    check_prune_widths,
    check_run,
    check_sequence_heads,
    check_sequence_length,
    freeze,
    wrap_class_problem,
)
from harness.engine import EnginePlan, hidden_size_of, plan_engine
from harness.errors import ConfigError
from harness.log import get_logger
from harness.memory import TILED_MLP, tiling_problem
from harness.models import (
    PRESETS,
    BlocksNotFound,
    CheckpointWeights,
    attention_is_swappable,
    decoder_block_list,
    empty_model,
    expert_parallel_problem,
    is_preset,
    model_config,
    resolve_targets,
)
from harness.pruning import experts_to_drop
from harness.runner.data_checks import check_data, check_vocabulary, looks_like_path, offline
from harness.runner.inputs import check_environment, check_index
from harness.runner.run_dir import check_not_in_use
from harness.training import router_refusal

log = get_logger(__name__)


def has_accelerator(device: str) -> bool:
    """Whether the run's `device` choice gets a GPU here."""
    return device != "cpu" and torch.cuda.is_available()


# ------------------------------------------------------------------ model


def model_shape(name: str) -> dict[str, Any] | None:
    """The config values of `model.name` the checks need (preset table or config.json); ConfigError if unfindable."""
    if is_preset(name):
        p = PRESETS[name]
        return {
            "max_position_embeddings": p.max_position_embeddings,
            "hidden_size": p.hidden_size,
            "intermediate_size": p.intermediate_size,
            "num_attention_heads": p.num_attention_heads,
            "num_key_value_heads": p.num_key_value_heads,
        }
    if os.path.isdir(name):
        path = os.path.join(name, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model.name '{name}' is a directory without config.json; point it at a Hugging Face model directory")
        check_weights(name)
        try:
            with open(path) as f:
                return json.load(f)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"model.name '{name}': config.json is not valid JSON ({str(exc).splitlines()[0]})") from None
    if looks_like_path(name):
        raise ConfigError(f"model.name '{name}' does not exist; give a preset ({', '.join(PRESETS)}), a local model directory or a hub id")
    cached = try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):
        with open(cached) as f:
            return json.load(f)
    if offline():
        raise ConfigError(
            f"model.name '{name}' is not a preset, a local directory or in the Hugging Face cache, and HF_HUB_OFFLINE=1 "
            "(no network); download it first or give a local path"
        )
    try:
        return AutoConfig.from_pretrained(name).to_dict()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name '{name}' was not found on the Hugging Face hub ({str(exc).splitlines()[0]})") from None


def check_weights(model_dir: str) -> None:
    """A model directory must hold weights, and every safetensors file must be readable (its
    header parses and its tensors lie inside the file): a truncated download is found here,
    not as a traceback on every rank after the process group started."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    legacy = glob.glob(os.path.join(model_dir, "pytorch_model*.bin"))
    if not files and not legacy:
        raise ConfigError(
            f"model.name '{model_dir}' has config.json but no weights (model.safetensors, shards with an index, "
            "or pytorch_model.bin); copy them in, or give a preset name to start from random weights"
        )
    for index in sorted(glob.glob(os.path.join(model_dir, "*.index.json"))):
        check_index(model_dir, index)
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                keys = list(f.keys())
        except Exception as exc:
            raise ConfigError(
                f"model weights '{path}' are not a readable safetensors file ({type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:120]}); download them again"
            ) from None
        if not keys:
            raise ConfigError(f"model weights '{path}' hold no tensors; download them again")


def block_users(cfg: RunConfig, strategy: Strategy) -> list[str]:
    """The settings that work block by block (and so need the model's decoder blocks)."""
    users = {
        "strategy=fsdp (one FSDP2 unit per block)": strategy.kind == "fsdp",
        f"memory.activation_checkpointing={cfg.memory.activation_checkpointing}": cfg.memory.activation_checkpointing != "none",
        "memory.compile=block": cfg.memory.compile == "block",
        f"{cfg.prune.named}": cfg.prune.enabled,
        "memory.layer_hooks": cfg.memory.layer_hooks,
    }
    return [what for what, used in users.items() if used]


def check_architecture(cfg: RunConfig, strategy: Strategy, layout: ParallelLayout) -> None:
    """A checkpoint's architecture is one transformers builds as a causal LM, and, where a setting
    works block by block, harness finds its decoder blocks (built on the meta device: no memory)."""
    name = cfg.model.name
    if is_preset(name) or not os.path.isdir(name):
        return  # presets are Llama; a hub id is checked once downloaded, by the same lookup on every rank
    try:
        config = model_config(name)
    except (ValueError, KeyError) as exc:  # an unknown model_type: this transformers cannot read the config
        raise ConfigError(
            f"model.name '{name}': transformers {transformers.__version__} cannot read its config.json ({str(exc).splitlines()[0][:160]})"
        ) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"model.name '{name}': model type '{config.model_type}' has no causal-LM class in transformers "
            f"{transformers.__version__} (AutoModelForCausalLM); harness trains causal LMs"
        )
    template = empty_model(config)
    if (refusal := router_refusal(template, aux_loss_coefficient(cfg.moe))) is not None:  # a mixture-of-experts loss it cannot have
        raise ConfigError(f"model.name '{name}': {refusal}")
    if layout.splits_sequences and not attention_is_swappable(template):
        raise ConfigError(
            f"model.name '{name}': parallel.sequence={layout.sequence} runs attention through transformers' "
            f"AttentionInterface with sdpa, which {type(template).__name__} does not use (eager attention only); set parallel.sequence=1"
        )
    if cfg.lora.enabled:  # what the adapters reach, refused here rather than on every rank after the launch
        try:
            targets = resolve_targets(template, cfg.lora, quiet=True)
        except ConfigError as exc:
            raise ConfigError(f"model.name '{name}': {exc}") from None
        if targets.parameters and strategy.kind == "deepspeed":  # its state dict drops peft's parameter adapters
            raise ConfigError(
                f"model.name '{name}': LoRA on stacked experts ({', '.join(targets.parameters)}) runs under single, ddp and "
                f"fsdp, not DeepSpeed (its checkpoints miss peft's per-expert adapters); set strategy=fsdp, or "
                "lora.target_parameters=[] to adapt attention only"
            )
    if TILED_MLP.is_on(cfg.memory) and (problem := tiling_problem(template)) is not None:
        raise ConfigError(f"model.name '{name}': {problem}")
    weights = CheckpointWeights(name, getattr(template, "base_model_prefix", ""))
    weights.follow_conversions(template)
    weights.check_shapes(template)
    users = block_users(cfg, strategy)
    if not users:
        return
    try:
        decoder_block_list(template)
    except BlocksNotFound as exc:
        raise ConfigError(
            f"model.name '{name}': {exc}; needed by {', '.join(users)}: turn those off (e.g. strategy=ddp or zero3, "
            "memory.activation_checkpointing=none)"
        ) from None


def check_experts(cfg: RunConfig, layout: ParallelLayout) -> None:
    """Expert parallelism needs a model whose experts transformers can split (its expert plan), in
    a count the expert dimension divides; expert pruning, experts to drop and enough left to route
    (built on the meta device: no memory)."""
    if cfg.prune.experts:
        experts_to_drop(empty_model(model_config(cfg.model.name)), cfg.prune)
    if not layout.splits_experts:
        return
    problem = expert_parallel_problem(empty_model(model_config(cfg.model.name)), layout.expert)
    if problem is not None:
        raise ConfigError(f"model.name '{cfg.model.name}': {problem}")


def check_wrap_classes(model_name: str, env: dict[str, str]) -> None:
    """`accelerate launch --fsdp_transformer_layer_cls_to_wrap` names classes of this model: its
    decoder block, which harness wraps (built on the meta device: no memory)."""
    if not env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        return
    template = empty_model(model_config(model_name))
    try:
        blocks = {type(block).__name__ for block in decoder_block_list(template)}
    except BlocksNotFound:
        blocks = set()  # refused by check_architecture, which names what needs the blocks
    problem = wrap_class_problem(env, {type(m).__name__ for m in template.modules()}, blocks)
    if problem is not None:
        raise ConfigError(problem)


def check_model(cfg: RunConfig) -> None:
    shape = model_shape(cfg.model.name)
    if shape is None:
        return
    check_sequence_length(cfg, shape)
    check_sequence_heads(cfg.parallel, shape)
    check_prune_widths(cfg.prune, shape)


# ------------------------------------------------------------------ data


# ------------------------------------------------------------------ output directory and resume


def check_run_exports(cfg: RunConfig) -> None:
    """The directories a run exports into at its end (`hf/`, `adapter/`) may only replace an earlier
    harness export, and only when this run continues (resume) or overwrites its directory."""
    c = cfg.checkpoint
    allowed = c.overwrite or c.resume != "none"
    for target, used in ((os.path.join(cfg.output_dir, "hf"), c.export_hf), (adapter_dir(cfg.output_dir), cfg.lora.enabled)):
        why = export_target_refusal(target, None, allowed, flag="checkpoint.overwrite=true (or checkpoint.resume=auto)") if used else ""
        if why:
            raise ConfigError(f"this run exports its model at the end, but {why}")


def check_output_and_resume(cfg: RunConfig, strategy: Strategy, layout: ParallelLayout) -> None:
    """Never overwrite silently, never share a live run's directory; a resume must continue the same run."""
    c = cfg.checkpoint
    if c.keep < 1:
        raise ConfigError(f"checkpoint.keep={c.keep} must be >= 1 (the newest checkpoint is always kept)")
    if c.max_consecutive_skips < 1:
        raise ConfigError(f"checkpoint.max_consecutive_skips={c.max_consecutive_skips} must be >= 1")
    if c.every < 0:
        raise ConfigError(f"checkpoint.every={c.every} must be >= 0 (0: only at the end)")
    out = cfg.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"output_dir '{out}' exists and is not a directory; choose another output_dir")
    parent = out if os.path.isdir(out) else os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"output_dir '{out}' cannot be created: '{parent}' is a file, not a directory; choose another output_dir")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"output_dir '{out}' is not writable ({parent} is read-only for this user)")
    check_not_in_use(cfg.output_dir)
    check_run_exports(cfg)
    root = checkpoint_root(out)
    existing = sorted(n for n in os.listdir(root) if n.startswith("step_")) if os.path.isdir(root) else []
    path = resume_path(c, out)  # a path that exists but holds no complete checkpoint: CheckpointError (exit 6)
    ours = path is not None and os.path.abspath(path).startswith(os.path.abspath(root) + os.sep)
    if existing and c.resume != "auto" and not ours and not c.overwrite:
        raise ConfigError(
            f"output_dir '{out}' already holds checkpoints of another run ({existing[-1]}); set checkpoint.resume=auto to "
            "continue it, checkpoint.overwrite=true to replace them, or choose another output_dir"
        )
    if path is None:
        return
    meta = verified_meta(path)  # a checkpoint lost or truncated since it was written: CheckpointError (exit 6), naming the file
    check_compatible(meta, path, cfg, strategy, layout, model_shape(cfg.model.name))
    last = cfg.steps + (cfg.prune.finetune_steps if cfg.prune.enabled else 0)
    if meta.step > last:
        raise ConfigError(
            f"checkpoint '{path}' is at step {meta.step} but this run ends at step {last} (steps={cfg.steps}); its later "
            f"weights would be saved under an earlier step's name: set steps >= {meta.step} to continue it, or resume from "
            "an earlier checkpoint"
        )
    later = later_checkpoints(root, meta.step, path)
    if later and not c.overwrite:
        names = ", ".join(os.path.basename(p) for p in later)
        raise ConfigError(
            f"resuming from '{path}' (step {meta.step}) would abandon this run's later checkpoints ({names}); resume from the "
            f"latest (checkpoint.resume=auto), or set checkpoint.overwrite=true to delete {names} and continue from step {meta.step}"
        )


# ------------------------------------------------------------------ the entry point


def preflight(user: RunConfig, strategy: Strategy, world: int | None = None) -> EnginePlan:
    """Every check that can fail before a process group starts; ConfigError (one line) on the first
    failure. The one resolution step: returns the engine plan (kind, resolved DeepSpeed dict,
    precision policy), made here once and handed to the engine builder, and with it the resolved
    run config (`plan.config`: the user's with what the launcher and a DeepSpeed file set taken in,
    read-only from here on; `user` stays as written), from whose sections every component builds
    itself. `world`: the world size, when the caller launches the ranks itself (a Ray driver); else
    the launcher's environment says."""
    cfg = user
    env_world = check_environment()  # the launcher's variables and HARNESS_* knobs, checked even when the caller gives the world
    world = env_world if world is None else world
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no GPU is visible; use device=auto or device=cpu")
    # The plan first: the run config takes what the launcher's flags and a DeepSpeed file set and it
    # leaves to defaults (every later check sees those values), and the file is resolved and checked
    # by DeepSpeed's own config classes; its "auto" bucket sizes need the model's width.
    hidden = hidden_size_of(model_shape(cfg.model.name) or {}) if strategy.kind == "deepspeed" else None
    plan = plan_engine(cfg, strategy, world, torch.device("cuda" if has_accelerator(cfg.device) else "cpu"), hidden)
    cfg = plan.config  # every later check sees the values taken in
    check_run(cfg, strategy, world, has_accelerator(cfg.device))
    if cfg.precision in ("bf16", "bf16_pure") and has_accelerator(cfg.device) and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"precision={cfg.precision} but {torch.cuda.get_device_name()} has no bf16 support; use precision=fp16 or fp32")
    check_model(cfg)
    check_architecture(cfg, strategy, plan.layout)
    check_experts(cfg, plan.layout)
    check_wrap_classes(cfg.model.name, dict(os.environ))
    check_data(cfg)
    check_vocabulary(cfg, model_shape(cfg.model.name) or {})
    check_output_and_resume(cfg, strategy, plan.layout)
    freeze(cfg)
    return plan
