"""The DeepSpeed engine: DeepSpeed owns the optimizer, loss scaling and ZeRO partitioning.

Its checkpoint is DeepSpeed's own sharded format (`save_checkpoint`: one optimizer
partition per rank). DeepSpeed cannot repartition that state for another world size, so
such a resume converts the checkpoint once with DeepSpeed's universal-checkpoint tool
(`ds_to_universal`) and loads it with `load_universal_checkpoint`.

DeepSpeed is imported where it is used, not at the top: importing it probes for
accelerators and logs, and runs under the torch engine should not pay for that.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from argparse import Namespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.config import OptimConfig, RunConfig
from harness.distributed import DistInfo
from harness.engine.base import Engine, LossFn, StepResult
from harness.engine.deepspeed_ulysses import alst_groups, alst_loss_divisor, checkpoint_io
from harness.engine.extension_lock import guarded_builds
from harness.engine.parallelize import WeightsToLoad, lora_base
from harness.engine.plan import EnginePlan
from harness.engine.probe import DeepSpeedProbe, GradientProbe
from harness.engine.state_bytes import deepspeed_state_bytes
from harness.errors import CheckpointError, ConfigError
from harness.log import get_logger
from harness.memory import prepare_model
from harness.models import (
    ModelSpec,
    apply_lora,
    clean_name,
    construct_model,
    empty_model,
    init_adapters,
    materialize,
    move_quantization_state,
    quantized_codes,
    without_quantization_state,
)
from harness.training import build_optimizer, lr_lambda

DS_TAG = "state"  # DeepSpeed's tag: <step dir>/ds/state/...
DS_UNIVERSAL = "ds_universal"  # <step dir>/ds_universal/state/...: written on first resume at another world size

log = get_logger(__name__)


class DeepSpeedEngine(Engine):
    """A DeepSpeed engine: it owns the optimizer, loss scaling and ZeRO partitioning."""

    checkpoint_format = "deepspeed"
    sequence_split_by = "DeepSpeed's Ulysses, ALST"  # DeepSpeed splits sequences itself
    owns_grad_accumulation = True

    def num_parameters(self) -> int:
        # ZeRO-3 replaces each parameter's data by an empty tensor; `ds_numel` keeps its size.
        return sum(int(getattr(p, "ds_numel", p.numel())) for p in self.module.parameters())

    def local_parameters(self) -> list[torch.Tensor]:
        out = []
        codes = quantized_codes(self.module)  # a quantized base's packed codes: bit patterns, not numbers
        for p in self.module.parameters():
            if id(p) in codes:
                continue
            t = getattr(p, "ds_tensor", None)  # ZeRO-3: this rank's partition
            t = p if t is None else t
            if t.numel():
                out.append(t.detach())
        return out

    def state_bytes(self) -> dict[str, int]:
        return deepspeed_state_bytes(self.ds)

    def save_state(self, directory: str) -> None:
        # The universal-checkpoint info declares a plain data-parallel model (no tensor/pipeline-parallel
        # patterns), which DeepSpeed's converter needs to repartition the state for another world size.
        from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE

        client = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
        # an adapters-only checkpoint: no quantization state of the frozen base either
        quantization = without_quantization_state(self.module) if self.trainable_only else contextlib.nullcontext()
        with quantization, checkpoint_io(self.ds):
            self.ds.save_checkpoint(
                os.path.join(directory, "ds"),
                tag=DS_TAG,
                client_state=client,
                save_latest=False,
                exclude_frozen_parameters=self.trainable_only,
            )

    def load_state(self, directory: str, saved_world_size: int, is_main: bool) -> None:
        if saved_world_size == dist.get_world_size():
            with checkpoint_io(self.ds):
                loaded, _ = self.ds.load_checkpoint(os.path.join(directory, "ds"), tag=DS_TAG, load_module_strict=not self.trainable_only)
        else:
            universal = os.path.join(directory, DS_UNIVERSAL)
            if is_main and not os.path.isdir(universal):
                log.info(
                    f"converting {directory} to a DeepSpeed universal checkpoint (world size {saved_world_size} -> {dist.get_world_size()})"
                )
                convert_to_universal(os.path.join(directory, "ds"), universal)
            dist.barrier()
            self.ds._config.load_universal_checkpoint = True  # read by load_checkpoint only
            try:
                with checkpoint_io(self.ds):
                    loaded, _ = self.ds.load_checkpoint(universal, tag=DS_TAG, load_module_strict=not self.trainable_only)
            finally:
                self.ds._config.load_universal_checkpoint = False
        if loaded is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint in {directory}")
        self._skipped_before = int(getattr(self.ds, "skipped_steps", 0))  # DeepSpeed restored its counter: count from it

    def __init__(
        self, plan: EnginePlan, ds_engine: Any, loss_fn: LossFn, grad_accum: int, device: torch.device, startup_s: dict[str, float]
    ):
        super().__init__(plan, loss_fn, grad_accum, device, startup_s)
        self.ds = ds_engine
        self.zero_stage = int(ds_engine.zero_optimization_stage())
        self.module = ds_engine.module
        # Forward must go through the DeepSpeed engine: calling the module directly skips its
        # per-micro-step bookkeeping, and ZeRO-3 then loses the first micro-batches' gradients.
        self.model = ds_engine
        self._skipped_before = 0
        self._loss_divisor = alst_loss_divisor(plan.layout.sequence, self.zero_stage)

    @classmethod
    def load_model(cls, spec: ModelSpec, cfg: RunConfig, plan: EnginePlan, info: DistInfo) -> nn.Module:
        """ZeRO-3: built under `zero.Init`, which partitions each parameter as its module is created,
        then each rank fills its partitions; LoRA's adapters (a fraction of a percent of the model)
        are then injected whole outside `zero.Init` and partitioned by `deepspeed.initialize`, as
        under HF Trainer + peft. ZeRO-0/1/2 keep the working weights whole on every rank: built on
        the device directly in DeepSpeed's working dtype (no fp32 copy to cast from), LoRA's base too.
        A QLoRA base under ZeRO-3 is built on the host and partitioned onto the device."""
        import deepspeed

        train_collectives_only()  # the first DeepSpeed call of every build
        ds_config = plan.deepspeed_config()
        dtype = _deepspeed_dtype(ds_config)
        if cfg.lora.enabled and cfg.lora.quantize != "none":
            # QLoRA (ZeRO-3 only: the config checks): every rank quantizes every weight on the host
            # (bitsandbytes is deterministic), the codes stored in the working dtype, which DeepSpeed's
            # bf16 cast leaves alone; `zero.Init(module=...)` then moves each parameter to the device and
            # partitions it in turn: the device holds this rank's part plus one tensor, the host held
            # the whole 4-bit base. (mem_efficient_linear would replace F.linear for the whole process.)
            model = lora_base(spec, cfg, torch.device("cpu"), dtype)
            deepspeed.comm.init_distributed(dist_backend=info.backend or "gloo", dist_init_required=False)
            deepspeed.zero.Init(module=model, config_dict_or_path=ds_config, mem_efficient_linear=False)
            return _beside_parameters_to(model, info.device)
        if cfg.lora.enabled and plan.zero_stage != 3:  # the working weights are whole on every rank anyway
            return lora_base(spec, cfg, info.device, dtype)
        weights = WeightsToLoad(spec)
        if plan.zero_stage == 3:
            # zero.Init reads the world size from DeepSpeed's communicator: wrap our process group first
            deepspeed.comm.init_distributed(dist_backend=info.backend or "gloo", dist_init_required=False)
            with deepspeed.zero.Init(config_dict_or_path=ds_config):
                model = construct_model(spec.config)
            if ds_config["zero_optimization"].get("offload_param", {}).get("device") == "nvme":
                _fill_gathered(weights, model, info.rank)
            else:
                weights.fill(model)
            if cfg.lora.enabled:
                model = apply_lora(model, cfg.lora, seed=cfg.model.seed)
                init_adapters(model, cfg.model.seed)  # the values every other build of this run starts from
                for name, p in model.named_parameters():
                    if p.requires_grad:  # the adapters; the base's partitions are already in `dtype` on the device
                        p.data = p.data.to(device=info.device, dtype=dtype)
        else:
            model = materialize(empty_model(spec.config).to(dtype=_deepspeed_dtype(ds_config)), info.device)
            weights.fill(model)
        prepare_model(model, cfg.memory)
        return model

    @classmethod
    def build(cls, spec: ModelSpec, cfg: RunConfig, plan: EnginePlan, info: DistInfo, loss_fn: LossFn) -> DeepSpeedEngine:
        with guarded_builds():  # DeepSpeed may JIT-build an op inside: never wait on a killed build's lock unbounded
            return cls._build(spec, cfg, plan, info, loss_fn)

    @classmethod
    def _build(cls, spec: ModelSpec, cfg: RunConfig, plan: EnginePlan, info: DistInfo, loss_fn: LossFn) -> DeepSpeedEngine:
        import deepspeed

        started = time.perf_counter()
        model = cls.load_model(spec, cfg, plan, info)
        loaded = time.perf_counter()
        strategy = plan.strategy
        ds_config = plan.deepspeed_config()
        filled = list(plan.deepspeed_filled)
        optimizer = None
        if "optimizer" not in ds_config:
            written = strategy.raw.get("zero_force_ds_cpu_optimizer")
            optimizer = _client_optimizer(model, cfg.optim, plan, ds_config)
            # DeepSpeed's own CPU optimizer needs no word on the key: the file's true (or DeepSpeed's default) accepts it
            ours = type(optimizer).__name__ != "DeepSpeedCPUAdam"
            if written is not None and ours:  # the file's own value stands (DeepSpeed then says why it refuses ours)
                ds_config["zero_force_ds_cpu_optimizer"] = written
            elif "zero_force_ds_cpu_optimizer" in ds_config and ours:
                filled.append(
                    f"zero_force_ds_cpu_optimizer={ds_config['zero_force_ds_cpu_optimizer']} "
                    f"(the client optimizer {type(optimizer).__name__} runs on the host)"
                )
        lr_scheduler = deepspeed_lr_scheduler(ds_config, cfg)
        used = "" if lr_scheduler else f"; the file's scheduler {ds_config['scheduler']['type']} drives the LR, not optim.schedule"
        log.info(f"DeepSpeed config {strategy.path}: filled from the run config: {', '.join(filled) or 'nothing'}{used}")
        for line in plan.deepspeed_ignored if info.is_main else ():
            log.warning(f"DeepSpeed config {strategy.path}: {line}")
        mpu = alst_groups(model, plan.layout.sequence, cfg.micro_batch_size, info) if plan.layout.splits_sequences else None
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            config=ds_config,
            mpu=mpu,
            dist_init_required=False,
        )
        startup = {"load": loaded - started, "engine_init": time.perf_counter() - loaded}
        built = cls(plan, engine, loss_fn, cfg.grad_accum, info.device, startup)
        built.sequence_group = mpu.get_sequence_parallel_group() if mpu is not None else None  # ALST's
        return built

    @property
    def optimizer(self) -> Any:
        return self.ds.optimizer

    def lr_schedulers(self) -> list[Any]:
        return [self.ds.lr_scheduler] if self.ds.lr_scheduler is not None else []

    def gradient_probe(self, grad_accum: int | None = None) -> GradientProbe:
        return DeepSpeedProbe(self.ds, grad_accum)

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        # DeepSpeed divides by gradient_accumulation_steps itself and knows the boundary.
        self.ds.backward(loss / self._loss_divisor if self._loss_divisor > 1 else loss)
        if not last_micro:
            self.ds.step()  # a no-op apart from DeepSpeed's micro-step bookkeeping

    def step(self, skip: bool = False) -> StepResult:
        """`skip`: every rank agreed this step's loss is non-finite (harness.reliability): drop the update."""
        # --- non-finite steps (harness.reliability): ZeRO and DeepSpeed's bf16/fp16 optimizers detect
        # a non-finite gradient and skip the step themselves. A bare torch optimizer (no ZeRO, fp32)
        # has no such check: DeepSpeed calls its step() unconditionally and would apply the NaN
        # update. For that one step we zero the gradients (DeepSpeed still clips them) and make the
        # optimizer's step() a no-op, so weights and optimizer state stay exactly as they were.
        own_norm, dropped = None, False
        optimizer = self.ds.optimizer
        if not hasattr(optimizer, "overflow"):
            params = [p for p in self.module.parameters() if p.grad is not None]
            if params:
                own_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params])))
            dropped = skip or (own_norm is not None and not math.isfinite(own_norm))
            if dropped:
                for p in params:
                    p.grad.zero_()
                optimizer.step = lambda *args, **kwargs: None  # instance attribute: shadows the class's step
        try:
            self.ds.step()
        finally:
            if dropped:
                del optimizer.step
        norm = self.ds.get_global_grad_norm()
        norm_f = float(norm) if norm is not None else (own_norm if own_norm is not None else float("nan"))
        skipped_now = int(getattr(self.ds, "skipped_steps", 0))
        skipped = dropped or skipped_now > self._skipped_before or not math.isfinite(norm_f)
        self._skipped_before = skipped_now
        self._run_post_step_hooks()
        return StepResult(norm_f, skipped)

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])


def train_collectives_only() -> None:
    """Keep DeepSpeed's communicator to torch.distributed's collectives, which are all training uses.
    On a CPU machine DeepSpeed's communicator otherwise builds and starts `deepspeed_shm_comm`: a C++
    op JIT-compiled on a machine's first DeepSpeed run (~50 CPU s, before the first step) whose one
    caller is `inference_all_reduce` (DeepSpeed's inference and AutoTP), and which maps a 69 MB POSIX
    segment per rank that it never unlinks. DeepSpeed decides by its probed `__compatible_ops__`,
    one dict kept so that edits to it hold; an op it cannot build there (a GPU machine's) is
    unaffected. Call before DeepSpeed's communicator starts."""
    import deepspeed.ops

    probed = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(probed, dict):
        probed["deepspeed_shm_comm"] = False


def deepspeed_lr_scheduler(ds_config: dict[str, Any], cfg: RunConfig) -> Any:
    """The `lr_scheduler` argument for `deepspeed.initialize`: harness's schedule, or None where the
    resolved config keeps a scheduler of the file's own. DeepSpeed prefers a client scheduler to
    its config's (`DeepSpeedEngine._configure_lr_scheduler`), so passing ours would silently
    replace the file's; `resolve_deepspeed_config` drops a `"type": "auto"` scheduler."""
    if "scheduler" in ds_config:
        return None
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.optim, cfg.steps))


def _deepspeed_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The dtype DeepSpeed keeps the module's working weights in (it casts the module itself)."""
    if ds_config.get("bf16", {}).get("enabled") is True:
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled") is True:
        return torch.float16
    return torch.float32


def _client_optimizer(model: nn.Module, optim: OptimConfig, plan: EnginePlan, ds_config: dict[str, Any]):
    """Our optimizer for DeepSpeed: DeepSpeed's CPU Adam where the plan says so (`host_adam`), else
    the run's optimizer, which DeepSpeed is told to accept on the host when the optimizer is offloaded."""
    params = [p for p in model.parameters() if p.requires_grad]
    if plan.cpu_adam:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(
                params,
                lr=optim.lr,
                betas=optim.betas,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                adamw_mode=optim.name == "adamw",
            )
        except Exception as exc:  # the op needs a compiler and DeepSpeed's build deps
            if plan.cpu_adam_forced:
                raise ConfigError(
                    f"{plan.strategy.path}: zero_force_ds_cpu_optimizer: true asks for DeepSpeedCPUAdam, which could not be "
                    f"built here ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}); "
                    "set it false to step torch's AdamW on the host"
                ) from None
            log.warning(f"DeepSpeedCPUAdam unavailable ({type(exc).__name__}); using torch AdamW on CPU")
    if plan.strategy.offload_optimizer != "none":
        ds_config["zero_force_ds_cpu_optimizer"] = False
    return build_optimizer(params, optim, fused=False)


def _beside_parameters_to(model: nn.Module, device: torch.device) -> nn.Module:
    """Buffers and the quantization state (not parameters, which ZeRO-3 placed) to `device`."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    move_quantization_state(model, device)
    return model


def _fill_gathered(weights: WeightsToLoad, model: nn.Module, rank: int) -> None:
    """ZeRO-3 with parameters offloaded to NVMe: a partition may be swapped out, so each parameter
    is gathered in turn, written whole by rank 0, then partitioned (and swapped) again."""
    import deepspeed

    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if rank == 0:
                names = [clean_name(name)]
                piece = weights.source.read(names, p.shape, 0, p.numel())
                p.data.view(-1).copy_(piece if piece is not None else weights.fallback.read(names, p.shape, 0, p.numel()))


def convert_to_universal(ds_dir: str, out_dir: str) -> None:
    """DeepSpeed's universal-checkpoint conversion (one process): lets ZeRO state load at any world size."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = f"{out_dir}.tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    args = Namespace(
        input_folder=os.path.join(ds_dir, DS_TAG),
        output_folder=os.path.join(tmp, DS_TAG),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    ds_to_universal(args)
    os.replace(tmp, out_dir)


def read_model_weights(directory: str, zero_stage: int, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The fp32 model weights of a checkpoint `save_state` wrote, whole, in one process: DeepSpeed's
    own `zero_to_fp32` consolidation (lazily loaded), or the module state of a stage-0 checkpoint."""
    ds_dir = os.path.join(directory, "ds")
    if zero_stage == 0:  # no ZeRO partitions: the module state is whole in the model-states file
        states = torch.load(os.path.join(ds_dir, DS_TAG, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False)
        return {k: v.float() for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(ds_dir, tag=DS_TAG, lazy_mode=True, exclude_frozen_parameters=trainable_only)
    return {k: v.contiguous() for k, v in lazy.items()}
