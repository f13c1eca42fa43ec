"""Engines: one interface over torch (single/DDP/FSDP2) and DeepSpeed training steps.

The training loop calls `forward_loss`, `backward` and `step` and never asks which engine
it has; that is how one loop serves every strategy, on CPU and GPU alike.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.precision import PrecisionPolicy

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool  # the optimizer step did not happen (non-finite gradients / fp16 overflow)


class Engine:
    """Common surface; subclasses fill in the engine-specific parts."""

    kind: str = "base"
    module: nn.Module  # the underlying HF model (for pruning, export, hooks)
    model: nn.Module  # what forward is called on

    def __init__(self, policy: PrecisionPolicy, loss_fn: LossFn, grad_accum: int, device: torch.device):
        self.policy = policy
        self.loss_fn = loss_fn
        self.grad_accum = grad_accum
        self.device = device

    activation_offload: bool = False  # memory.activation_offload: saved activations go to host memory

    def forward_loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        offload = contextlib.nullcontext()
        if self.activation_offload and torch.is_grad_enabled():
            from harness.activation_offload import ActivationOffload

            offload = ActivationOffload()
        with self.policy.autocast_context(self.device), offload:
            return self.loss_fn(self.model, input_ids)

    @torch.no_grad()
    def eval_loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.forward_loss(input_ids)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    # engine-specific
    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        raise NotImplementedError

    def step(self) -> StepResult:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        raise NotImplementedError

    @property
    def optimizer(self) -> Any:
        raise NotImplementedError


class TorchEngine(Engine):
    """Single process, DDP or FSDP2 with a torch optimizer (optionally stepped in backward)."""

    def __init__(
        self,
        kind: str,
        module: nn.Module,
        model: nn.Module,
        optimizer: Any,
        scheduler: Any,
        policy: PrecisionPolicy,
        loss_fn: LossFn,
        grad_accum: int,
        grad_clip: float,
        device: torch.device,
        optimizer_in_backward: Any = None,
    ):
        super().__init__(policy, loss_fn, grad_accum, device)
        self.kind = kind
        self.module = module
        self.model = model
        self._optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.oib = optimizer_in_backward  # harness.optimizer_in_backward object or None
        self.scaler = torch.amp.GradScaler(device.type) if policy.uses_scaler else None

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def _sync_context(self, last_micro: bool):
        if self.kind == "ddp" and not last_micro:
            return self.model.no_sync()
        if self.kind == "fsdp":
            # FSDP2: skip the reduce-scatter on all but the last micro-batch.
            self.model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        if self.oib is not None:
            self.oib.set_last_micro_batch(last_micro)
        scaled = loss / self.grad_accum
        with self._sync_context(last_micro):
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def step(self, skip: bool = False) -> StepResult:
        """`skip`: every rank agreed this step's loss is non-finite (harness.failures): drop the update."""
        if self.oib is not None:
            # The optimizer already stepped inside backward; it reports the norm it saw.
            norm = self.oib.last_grad_norm()
            skipped = not math.isfinite(norm)
            self.scheduler.step()
            return StepResult(norm, skipped)
        if self.scaler is not None:
            self.scaler.unscale_(self._optimizer)
        params = self._params()
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm_f = float(norm)
        skipped = skip or not math.isfinite(norm_f)
        if self.scaler is not None:
            if not skip:
                self.scaler.step(self._optimizer)  # skips the step itself on inf/nan
            self.scaler.update()
        elif not skipped:
            self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepResult(norm_f, skipped)

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])


class DeepSpeedEngine(Engine):
    """A DeepSpeed engine: it owns the optimizer, loss scaling and ZeRO partitioning."""

    kind = "deepspeed"

    def __init__(self, ds_engine: Any, policy: PrecisionPolicy, loss_fn: LossFn, grad_accum: int, device: torch.device):
        super().__init__(policy, loss_fn, grad_accum, device)
        self.ds = ds_engine
        self.module = ds_engine.module
        # Forward must go through the DeepSpeed engine: calling the module directly skips its
        # per-micro-step bookkeeping, and ZeRO-3 then loses the first micro-batches' gradients.
        self.model = ds_engine
        self._skipped_before = 0

    @property
    def optimizer(self) -> Any:
        return self.ds.optimizer

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        # DeepSpeed divides by gradient_accumulation_steps itself and knows the boundary.
        self.ds.backward(loss)
        if not last_micro:
            self.ds.step()  # a no-op apart from DeepSpeed's micro-step bookkeeping

    def step(self, skip: bool = False) -> StepResult:
        """`skip`: every rank agreed this step's loss is non-finite (harness.failures): drop the update."""
        # --- non-finite steps (harness.failures): ZeRO and DeepSpeed's bf16/fp16 optimizers detect
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
        return StepResult(norm_f, skipped)

    def checkpoint_loaded(self) -> None:
        """After a resume (harness.checkpoint): DeepSpeed restored its skipped-step counter; count from it."""
        self._skipped_before = int(getattr(self.ds, "skipped_steps", 0))

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])
