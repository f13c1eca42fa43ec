"""Distribution applied in one place: precision cast, memory techniques, then the engine.

Order follows torchtitan: activation checkpointing → compile → sharding (FSDP2) or
DeepSpeed's initialize. The model code is never edited; everything wraps it from outside.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from harness.config import RunConfig, Strategy, resolve_deepspeed_config
from harness.distributed import DistInfo
from harness.engine.base import Engine, LossFn
from harness.engine.deepspeed_engine import DeepSpeedEngine
from harness.engine.storage import local_part
from harness.engine.torch_engine import TorchEngine
from harness.log import get_logger
from harness.memory import OptimizerInBackward, apply_activation_checkpointing, apply_compile
from harness.models import (
    ModelSpec,
    build_run_model,
    clean_name,
    construct_model,
    decoder_blocks,
    empty_model,
    fill,
    is_quantized,
    materialize,
)
from harness.training import PrecisionPolicy, build_optimizer, build_scheduler, lr_lambda

log = get_logger(__name__)


def apply_memory_techniques(model: nn.Module, cfg: RunConfig) -> None:
    """Activation checkpointing and compile, before any sharding wraps the blocks."""
    mem = cfg.memory
    if mem.activation_checkpointing != "none":
        apply_activation_checkpointing(model, mem.activation_checkpointing, mem.ac_every)
    if mem.compile != "none" or mem.activation_memory_budget is not None:
        apply_compile(model, mem.compile if mem.compile != "none" else "model", mem.activation_memory_budget)


def fsdp_wrap(model: nn.Module, strategy: Strategy, policy: PrecisionPolicy, info: DistInfo) -> nn.Module:
    """FSDP2: shard the embeddings, each decoder block, the LM head, and the root.

    The head is its own unit (kept gathered after forward: backward needs it at once), so
    its large weight is not gathered with the root's small leftovers (final norm, rotary
    buffers). A head tied to the input embeddings shares one weight, which one group must
    own: the root's (the weight is used at the start and at the end of the forward anyway).
    Called on the meta model: each rank then allocates only its shards. One module per
    `fully_shard` call: torch's FSDPMemTracker instruments each
    module's parameter group once, and a group shared by two modules breaks its tracking.
    """
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": strategy.reshard_after_forward}
    if policy.mode == "bf16":
        reduce = torch.float32 if strategy.reduce_dtype == "fp32" else torch.bfloat16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    if strategy.offload_params != "none":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None and not tied:  # tied input/output embeddings: one weight, left to the root's group
        fully_shard(embed, **kwargs)
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    if head is not None and not tied:
        fully_shard(head, **{**kwargs, "reshard_after_forward": False})
    fully_shard(model, **kwargs)
    return model


def _torch_model(spec: ModelSpec, cfg: RunConfig, strategy: Strategy, policy: PrecisionPolicy, info: DistInfo) -> nn.Module:
    """Single, DDP: the model built directly on the device in its working dtype. FSDP2: built on
    the meta device, sharded, then each rank allocates and fills only its shards."""
    if cfg.lora.enabled:
        return _lora_model(spec, cfg, strategy, policy, info)
    model = empty_model(spec.config).to(dtype=policy.param_dtype)
    weights = WeightsToLoad(spec)
    if _torch_kind(strategy, info) == "fsdp":
        apply_memory_techniques(model, cfg)
        fsdp_wrap(model, strategy, policy, info)
        weights.fill(materialize(model, info.device))
    else:
        weights.fill(materialize(model, info.device))
        apply_memory_techniques(model, cfg)
    return model


def _lora_model(spec: ModelSpec, cfg: RunConfig, strategy: Strategy, policy: PrecisionPolicy, info: DistInfo) -> nn.Module:
    """LoRA/QLoRA: peft injects adapters into a built model, so the frozen base is built whole on
    each rank (a QLoRA base quantized on load by bitsandbytes), then sharded like any model."""
    model = _lora_base(spec, cfg, info, policy.param_dtype)
    if _torch_kind(strategy, info) == "fsdp":
        fsdp_wrap(model, strategy, policy, info)
    return model


def _lora_base(spec: ModelSpec, cfg: RunConfig, info: DistInfo, dtype: torch.dtype) -> nn.Module:
    """The frozen base built whole with its adapters, on the device in `dtype`, AC and compile applied."""
    model = build_run_model(cfg, spec.config.vocab_size, info.device.index or 0)
    if not is_quantized(model):  # a QLoRA base was placed and typed by bitsandbytes on load
        model.to(device=info.device, dtype=dtype)
    apply_memory_techniques(model, cfg)
    return model


def _torch_kind(strategy: Strategy, info: DistInfo) -> str:
    return "single" if not info.distributed else strategy.kind


def _torch_engine(model: nn.Module, cfg: RunConfig, strategy: Strategy, policy: PrecisionPolicy, info: DistInfo, loss_fn: LossFn) -> Engine:
    kind = _torch_kind(strategy, info)
    wrapped: nn.Module = model  # FSDP2 shards in place
    if kind == "ddp":
        ids = [info.device.index] if info.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    oib = None
    if cfg.memory.optimizer_in_backward:
        oib = OptimizerInBackward(wrapped, cfg.optim, cfg.steps)
        optimizer, scheduler = oib, oib.scheduler
    else:
        optimizer = build_optimizer(wrapped.parameters(), cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps)
    return TorchEngine(kind, model, wrapped, optimizer, scheduler, policy, loss_fn, cfg.grad_accum, cfg.optim.grad_clip, info.device, oib)


def deepspeed_lr_scheduler(ds_config: dict[str, Any], cfg: RunConfig) -> Any:
    """The `lr_scheduler` argument for `deepspeed.initialize`: harness's schedule, or None where the
    resolved config keeps a scheduler of the file's own. DeepSpeed prefers a client scheduler to
    its config's (`DeepSpeedEngine._configure_lr_scheduler`), so passing ours would silently
    replace the file's; `resolve_deepspeed_config` drops a `"type": "auto"` scheduler."""
    if "scheduler" in ds_config:
        return None
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.optim, cfg.steps))


def _deepspeed_model(spec: ModelSpec, cfg: RunConfig, strategy: Strategy, policy: PrecisionPolicy, info: DistInfo) -> nn.Module:
    """ZeRO-3: built under `zero.Init`, which partitions each parameter as its module is created,
    then each rank fills its partitions. ZeRO-0/1/2 keep the working weights whole on every rank:
    built on the device directly in DeepSpeed's working dtype (no fp32 copy to cast from)."""
    import deepspeed

    ds_config = resolve_deepspeed_config(strategy, cfg, info.world_size, getattr(spec.config, "hidden_size", None))
    if cfg.lora.enabled:  # adapters need a built model: the frozen base whole, partitioned by deepspeed.initialize
        return _lora_base(spec, cfg, info, _deepspeed_dtype(ds_config))
    weights = WeightsToLoad(spec)
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        # zero.Init reads the world size from DeepSpeed's communicator: wrap our process group first
        deepspeed.comm.init_distributed(dist_backend=info.backend or "gloo", dist_init_required=False)
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = construct_model(spec.config)
        if ds_config["zero_optimization"].get("offload_param", {}).get("device") == "nvme":
            weights.fill_gathered(model, info.rank)
        else:
            weights.fill(model)
    else:
        model = materialize(empty_model(spec.config).to(dtype=_deepspeed_dtype(ds_config)), info.device)
        weights.fill(model)
    apply_memory_techniques(model, cfg)
    return model


def _deepspeed_engine(
    model: nn.Module, cfg: RunConfig, strategy: Strategy, policy: PrecisionPolicy, info: DistInfo, loss_fn: LossFn
) -> Engine:
    import deepspeed

    hidden = getattr(model.config, "hidden_size", None)
    filled: list[str] = []
    ds_config = resolve_deepspeed_config(strategy, cfg, info.world_size, hidden, filled=filled)
    optimizer = None
    if "optimizer" not in ds_config:
        written = strategy.raw.get("zero_force_ds_cpu_optimizer")
        optimizer = _client_optimizer(model, cfg, strategy, ds_config)
        if written is not None:  # the file's own value stands (DeepSpeed then says why it refuses our optimizer)
            ds_config["zero_force_ds_cpu_optimizer"] = written
        elif "zero_force_ds_cpu_optimizer" in ds_config:
            filled.append(
                f"zero_force_ds_cpu_optimizer={ds_config['zero_force_ds_cpu_optimizer']} "
                f"(the client optimizer {type(optimizer).__name__} runs on the host)"
            )
    lr_scheduler = deepspeed_lr_scheduler(ds_config, cfg)
    used = "" if lr_scheduler else f"; the file's scheduler {ds_config['scheduler']['type']} drives the LR, not optim.schedule"
    log.info(f"DeepSpeed config {strategy.path}: filled from the run config: {', '.join(filled) or 'nothing'}{used}")
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        config=ds_config,
        dist_init_required=False,
    )
    return DeepSpeedEngine(engine, policy, loss_fn, cfg.grad_accum, info.device)


def _deepspeed_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The dtype DeepSpeed keeps the module's working weights in (it casts the module itself)."""
    if ds_config.get("bf16", {}).get("enabled") is True:
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled") is True:
        return torch.float16
    return torch.float32


class WeightsToLoad:
    """The spec's weights (a checkpoint or the seeded init) written into whatever part of each
    parameter this rank stores, read from a template of the model kept on the meta device."""

    def __init__(self, spec: ModelSpec):
        self.template = empty_model(spec.config)
        self.source = spec.source(self.template)
        self.fallback = spec.fallback(self.template)

    def fill(self, model: nn.Module) -> None:
        fill(model, self.source, part_of=local_part, fallback=self.fallback)

    def fill_gathered(self, model: nn.Module, rank: int) -> None:
        """ZeRO-3 with parameters offloaded to NVMe: a partition may be swapped out, so each parameter
        is gathered in turn, written whole by rank 0, then partitioned (and swapped) again."""
        import deepspeed

        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
                if rank == 0:
                    names = [clean_name(name)]
                    piece = self.source.read(names, p.shape, 0, p.numel())
                    p.data.view(-1).copy_(piece if piece is not None else self.fallback.read(names, p.shape, 0, p.numel()))


def _client_optimizer(model: nn.Module, cfg: RunConfig, strategy: Strategy, ds_config: dict[str, Any]):
    """Our optimizer for DeepSpeed; with optimizer offload on a GPU machine, DeepSpeed's CPU Adam.

    DeepSpeedCPUAdam is the fast path when the model lives on a GPU and its optimizer on the
    host. On a CPU-only machine both already share the host, and its C++ op costs a minute of
    JIT build, so we pass torch's AdamW and tell DeepSpeed to accept it; likewise where the
    op cannot be built (`zero_force_ds_cpu_optimizer: false`).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if strategy.offload_optimizer != "none" and cfg.optim.name in ("adamw", "adam"):
        if torch.cuda.is_available() and os.environ.get("HARNESS_DS_CPU_ADAM", "1") == "1":
            try:
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(
                    params,
                    lr=cfg.optim.lr,
                    betas=cfg.optim.betas,
                    eps=cfg.optim.eps,
                    weight_decay=cfg.optim.weight_decay,
                    adamw_mode=cfg.optim.name == "adamw",
                )
            except Exception as exc:  # the op needs a compiler and DeepSpeed's build deps
                log.warning(f"DeepSpeedCPUAdam unavailable ({type(exc).__name__}); using torch AdamW on CPU")
        ds_config["zero_force_ds_cpu_optimizer"] = False
    return build_optimizer(params, cfg.optim)


def load_model(spec: ModelSpec, cfg: RunConfig, strategy: Strategy, policy: PrecisionPolicy, info: DistInfo) -> nn.Module:
    """The load phase: the model built, its memory techniques applied, sharded where the strategy
    shards, and filled, without any rank holding more than its part plus one tensor."""
    load = _deepspeed_model if strategy.kind == "deepspeed" else _torch_model
    return load(spec, cfg, strategy, policy, info)


def build_engine(spec: ModelSpec, cfg: RunConfig, strategy: Strategy, policy: PrecisionPolicy, info: DistInfo, loss_fn: LossFn) -> Engine:
    """Load the model (`load_model`), then the engine around it; `engine.startup_s` says how long each took."""
    started = time.perf_counter()
    model = load_model(spec, cfg, strategy, policy, info)
    loaded = time.perf_counter()
    build = _deepspeed_engine if strategy.kind == "deepspeed" else _torch_engine
    engine = build(model, cfg, strategy, policy, info, loss_fn)
    engine.activation_offload = cfg.memory.activation_offload
    engine.startup_s = {"load": loaded - started, "engine_init": time.perf_counter() - loaded}
    engine.trainable_only = cfg.lora.enabled  # LoRA checkpoints keep the adapters; the base comes from model.name
    return engine
