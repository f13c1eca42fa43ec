"""The torch engines: one process (`TorchEngine`), DDP (`DDPEngine`) or FSDP2 (`FSDPEngine`), with a
torch optimizer (or one stepped in backward). Each subclass owns what its engine does differently
(how the model is wrapped or sharded, when gradients are reduced under accumulation, what a
no-grad forward leaves behind); nothing outside `harness.engine.build` knows which one it has.

Its checkpoint is a `torch.distributed.checkpoint` (DCP) directory keyed by parameter FQN:
under FSDP2 each rank writes only its DTensor shards, and loading reshards to any world
size (FSDP2 <-> single/DDP, 2 <-> 1 ranks).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from harness.config import MemoryConfig, RunConfig
from harness.distributed import DistInfo, local_tensor
from harness.engine.base import Engine, LossFn, StepResult
from harness.engine.experts import ExpertGradients, split_for
from harness.engine.parallelize import WeightsToLoad, empty_model_to_train, fsdp_wrap
from harness.engine.plan import EnginePlan
from harness.engine.probe import GradientProbe
from harness.engine.state_bytes import StateCounter, optimizer_state_tensors
from harness.memory import OptimizerInBackward, prepare_model
from harness.models import ModelSpec, materialize, quant_state_tensors, quantized_codes, use_ulysses
from harness.training import build_optimizer, build_scheduler


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _group_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class TorchEngine(Engine):
    """One process with a torch optimizer (optionally stepped in backward); the base of DDP and
    FSDP2, which override the hooks below where they differ."""

    checkpoint_format = "torch"
    sequence_split_by = "Ulysses"  # harness's own, over transformers' attention registry

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def local_parameters(self) -> list[torch.Tensor]:
        codes = quantized_codes(self.model)  # bit patterns, not numbers
        return [local_tensor(p).detach() for p in self.model.parameters() if local_tensor(p).numel() and id(p) not in codes]

    def state_bytes(self) -> dict[str, int]:
        """Local shards of parameters, their gradients and optimizer state."""
        counter = StateCounter()
        params = list(self.model.parameters())
        counter.add("params", params)
        counter.add("params", quant_state_tensors(self.model))  # a quantized base's scales, held whole by every rank
        counter.add("grads", [p.grad for p in params if p.grad is not None])
        # optimizer-in-backward holds one optimizer per parameter, in a dict keyed by the parameter
        per_param = getattr(self._optimizer, "optimizers", None)
        optimizers = list(per_param.values()) if isinstance(per_param, dict) else [self._optimizer]
        for opt in optimizers:
            if opt is not None:
                counter.add("optim_state", optimizer_state_tensors(opt))
        return counter.bytes

    # ------------------------------------------------------------------ checkpoints
    def _dcp_state(self) -> dict[str, Any]:
        """Model and optimizer state keyed by parameter FQN: DTensor shards under FSDP2, so DCP reshards."""
        if isinstance(self._optimizer, torch.optim.Optimizer):
            optim_sd = get_optimizer_state_dict(self.model, self._optimizer)
        else:  # optimizer-in-backward: already FQN-keyed through DCP's helpers
            optim_sd = self._optimizer.state_dict()
        options = StateDictOptions(ignore_frozen_params=self.trainable_only)
        model_sd = get_model_state_dict(self.model, options=options)
        if self.trainable_only:
            model_sd = drop_frozen_aliases(model_sd, self.model)
        return {"model": model_sd, "optim": optim_sd}

    def save_state(self, directory: str) -> None:
        with _quiet_dcp():
            dcp.save(self._dcp_state(), checkpoint_id=f"{directory}/dcp", no_dist=not _group_initialized())

    def load_state(self, directory: str, saved_world_size: int, is_main: bool) -> None:
        state = self._dcp_state()  # the targets: this run's shapes and placements (DCP reshards into them)
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=f"{directory}/dcp", no_dist=not _group_initialized())
        # trainable_only: the frozen base is not in the checkpoint (it was rebuilt from model.name)
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=not self.trainable_only))
        if isinstance(self._optimizer, torch.optim.Optimizer):
            set_optimizer_state_dict(self.model, self._optimizer, state["optim"])
        else:
            self._optimizer.load_state_dict(state["optim"])

    def trainer_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scheduler": self.scheduler.state_dict()}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def lr_schedulers(self) -> list[Any]:
        return list(getattr(self.scheduler, "schedulers", [self.scheduler]))  # optimizer-in-backward: one per optimizer

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def __init__(
        self,
        plan: EnginePlan,
        module: nn.Module,
        model: nn.Module,
        optimizer: Any,
        scheduler: Any,
        loss_fn: LossFn,
        grad_accum: int,
        grad_clip: float,
        device: torch.device,
        startup_s: dict[str, float],
        optimizer_in_backward: OptimizerInBackward | None = None,
    ):
        super().__init__(plan, loss_fn, grad_accum, device, startup_s)
        self.module = module
        self.model = model
        self._optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self._oib = optimizer_in_backward  # steps each parameter inside backward, or None
        self.scaler = torch.amp.GradScaler(device.type) if self.policy.uses_scaler else None
        self._norm: torch.Tensor | None = None  # this step's clipped gradient norm, from `grad_norm()`
        self.sequence_group = getattr(module, "harness_sequence_group", None)
        calls = getattr(module, "harness_ulysses_calls", None)
        if calls is not None:
            self._after_first_forward.append(lambda: calls.check_ran(module))
        split: ExpertGradients | None = getattr(module, "harness_experts", None)
        self._experts = split.bind(module) if split is not None else None  # experts split over ranks: their own reduction

    @classmethod
    def load_model(cls, spec: ModelSpec, cfg: RunConfig, plan: EnginePlan, info: DistInfo) -> nn.Module:
        """Single, DDP: the model built on the meta device, then allocated and filled on the device
        in its working dtype. FSDP2: built on the meta device, AC and compile applied, sharded, then
        each rank allocates and fills only its shards. LoRA: the adapters are injected into the meta
        model first, so a LoRA run loads like a full fine-tune (each rank its part); QLoRA too: its
        linears are bitsandbytes' quantized ones, each weight quantized whole from the checkpoint
        and only this rank's part of its codes kept."""
        model = empty_model_to_train(spec, cfg.lora, plan.precision)
        if plan.layout.splits_sequences:  # the group and the call count travel with the model to the engine
            model.harness_sequence_group = plan.layout.sequence_group(info.device.type)
            model.harness_ulysses_calls = use_ulysses(model, model.harness_sequence_group, cfg.data.packs_examples)
        if plan.layout.splits_experts:  # on the meta model: each rank then allocates and fills only its experts
            model.harness_experts = split_for(model, plan.layout, info.device.type)
        cls._prepare_and_fill(model, WeightsToLoad(spec, lora=cfg.lora.enabled, model=model), cfg.memory, plan, info)
        return model

    @classmethod
    def _prepare_and_fill(cls, model: nn.Module, weights: WeightsToLoad, memory: MemoryConfig, plan: EnginePlan, info: DistInfo) -> None:
        """Whole parameters on every rank: allocated and filled, then the memory techniques applied."""
        weights.fill(materialize(model, info.device))
        prepare_model(model, memory)

    @classmethod
    def _wrap(cls, model: nn.Module, info: DistInfo) -> nn.Module:
        """What the optimizer and the forward see: the model itself (one process)."""
        return model

    @classmethod
    def build(cls, spec: ModelSpec, cfg: RunConfig, plan: EnginePlan, info: DistInfo, loss_fn: LossFn) -> TorchEngine:
        started = time.perf_counter()
        model = cls.load_model(spec, cfg, plan, info)
        loaded = time.perf_counter()
        wrapped = cls._wrap(model, info)
        oib = None
        if plan.optimizer_in_backward:
            oib = OptimizerInBackward(wrapped, cfg.optim, cfg.steps)
            optimizer, scheduler = oib, oib.scheduler
        else:
            optimizer = build_optimizer(wrapped.parameters(), cfg.optim)
            scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps)
        startup = {"load": loaded - started, "engine_init": time.perf_counter() - loaded}
        return cls(plan, model, wrapped, optimizer, scheduler, loss_fn, cfg.grad_accum, cfg.optim.grad_clip, info.device, startup, oib)

    @property
    def steps_in_backward(self) -> bool:
        return self._oib is not None

    def backward_without_step(self) -> contextlib.AbstractContextManager[None]:
        return self._oib.micro_batch(last=False) if self._oib is not None else contextlib.nullcontext()

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def gradient_probe(self, grad_accum: int | None = None) -> GradientProbe:
        return GradientProbe(self.model, grad_accum or self.grad_accum)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _sync_gradients(self, last_micro: bool) -> None:
        """Where an engine decides in backward whether this micro-batch's gradients are reduced."""

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        if self._oib is not None:
            self._oib.set_last_micro_batch(last_micro)
        self._sync_gradients(last_micro)
        scaled = loss / self.grad_accum
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()
        if last_micro and self._experts is not None:
            self._experts.reduce()  # what DDP did for the rest: the replicas' sum, the world's mean

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def grad_norm(self) -> torch.Tensor | None:
        if self._oib is not None:  # stepped inside backward: its optimizer reports the norm it saw
            return None
        if self._norm is None:
            if self.scaler is not None:
                self.scaler.unscale_(self._optimizer)
            params = self._params()
            max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
            if self._experts is not None:
                norm = self._experts.clip(params, max_norm)
            else:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros((), device=self.device)
            self._norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return self._norm

    def step(self, skip: bool = False) -> StepResult:
        """`skip`: every rank agreed to drop this update (a non-finite loss; after `grad_norm()`, also
        a non-finite norm). Without a prior `grad_norm()` the norm is measured and read here."""
        if self._oib is not None:
            # The optimizer already stepped inside backward; it reports the norm it saw.
            norm = self._oib.last_grad_norm()
            skipped = not math.isfinite(norm)
            self.scheduler.step()
            self._run_post_step_hooks()
            return StepResult(norm, skipped)
        agreed = self._norm is not None  # the caller read the norm's finiteness into `skip`
        norm = self.grad_norm()
        self._norm = None
        if agreed:
            result = StepResult(norm, skip)
        else:
            norm_f = float(norm)
            result = StepResult(norm_f, skip or not math.isfinite(norm_f))
        if self.scaler is not None:
            if not skip:
                self.scaler.step(self._optimizer)  # skips the step itself on inf/nan
            self.scaler.update()
        elif not result.skipped:
            self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._run_post_step_hooks()
        return result

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])


class DDPEngine(TorchEngine):
    """DDP: whole parameters on every rank, gradients all-reduced once per optimizer step."""

    @classmethod
    def _wrap(cls, model: nn.Module, info: DistInfo) -> nn.Module:
        ids = [info.device.index] if info.device.type == "cuda" else None
        experts = getattr(model, "harness_experts", None)
        if experts is not None:  # each rank's are other experts: neither broadcast nor averaged by DDP
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts.names)
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[None]:
        # `no_sync` must cover the forward, where DDP's reducer is armed for the backward
        return contextlib.nullcontext() if last else self.model.no_sync()


class FSDPEngine(TorchEngine):
    """FSDP2: each rank holds its shards of every parameter, gradient and optimizer state."""

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)
        if mode:
            # A no-grad forward leaves reshard_after_forward=False groups unsharded: their parameters
            # would not be the optimizer's (a checkpoint save would fail). Reshard before training on.
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    @classmethod
    def _prepare_and_fill(cls, model: nn.Module, weights: WeightsToLoad, memory: MemoryConfig, plan: EnginePlan, info: DistInfo) -> None:
        """On the meta model: the memory techniques, then the shards; each rank then allocates and
        fills only its own."""
        prepare_model(model, memory)
        experts: ExpertGradients | None = getattr(model, "harness_experts", None)
        fsdp_wrap(model, plan.strategy, plan.precision, plan.layout.shard_mesh(info.device.type), experts)
        weights.fill(materialize(model, info.device))

    # Gradients are reduce-scattered after every micro-batch, accumulating in the sharded `.grad`
    # (torchtitan's choice, and ZeRO's): skipping the reduce-scatter until the last micro-batch
    # (`set_requires_gradient_sync(False)`) keeps every group's unsharded gradient alive across the
    # accumulation, the whole model's gradients on every rank (Qwen3-30B-A3B at 8 ranks: 113 GiB
    # planned), which is what sharding is for. The price: a reduce-scatter per micro-batch, not per step.


def drop_frozen_aliases(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """`state` with only the entries that are a trainable parameter. torch drops frozen
    parameters by `named_parameters()`, which lists a tied weight once: a tied model's frozen
    `lm_head.weight` (the embedding's storage) stays, the largest tensor of a LoRA checkpoint;
    and a quantized linear adds its quantization state (bitsandbytes' `weight.absmax`, ...),
    which is no parameter at all. Entries are matched to the trainable parameters by storage,
    not by name."""
    trainable = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters() if p.requires_grad and local_tensor(p).numel()}

    def is_trainable(value: Any) -> bool:
        local = local_tensor(value) if isinstance(value, torch.Tensor) else None
        return local is not None and (local.numel() == 0 or local.untyped_storage().data_ptr() in trainable)

    return {k: v for k, v in state.items() if is_trainable(v)}


def read_model_weights(directory: str, model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint `save_state` wrote, whole, in one process: DCP reassembles
    each tensor from however many shards were written and never reads the optimizer entries.
    `model` (empty storage is fine) gives the keys, shapes and dtypes; `trainable_only`: the
    checkpoint holds only the parameters that require gradients (a LoRA run's adapters)."""
    wanted = {name for name, p in model.named_parameters() if p.requires_grad or not trainable_only}
    state = {"model": {k: v for k, v in model.state_dict().items() if k in wanted or not trainable_only}}
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=f"{directory}/dcp", no_dist=True)
    return state["model"]
