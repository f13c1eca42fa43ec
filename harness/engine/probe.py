"""Gradient probes: backward passes that measure gradients without an optimizer step, the way
each engine must run them. Pruning's calibration (`harness.pruning.calibration.Runner`) asks a
`GradientProbe` and never which engine or wrapper it has.

What differs, and is answered here:
- who divides the loss by the accumulation steps (DeepSpeed does it in its own backward);
- where a probe step ends: a probe step is not an optimizer step, so DeepSpeed's micro-step
  counter cannot tell; the probe marks the boundary (ZeRO-1/2's gradient reduction) itself and
  hands DeepSpeed's own decision back afterwards;
- whether the probed weights' gradients can be computed alone (`torch.autograd.grad`): only
  where this process holds them whole (one process, DDP), not as FSDP2 DTensors or ZeRO
  partitions, whose engines reduce gradients inside their own backward hooks;
- DDP's reducer, which such a partial backward bypasses (`no_sync`, then an explicit average).

`gradient_probe(obj)` picks the probe for a harness `Engine` (its own `gradient_probe()`), a
DeepSpeed engine, DDP, an FSDP2 module or a plain module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from harness.distributed import Collectives, is_deepspeed_engine, unwrap


class GradientProbe:
    """Probe backwards through a torch model: a plain module, DDP or FSDP2."""

    def __init__(self, model: nn.Module, grad_accum: int | None = None) -> None:
        self.model = model  # what forward is called on
        self.module: nn.Module = unwrap(model)  # the user's model inside any wrapper
        self.accum = grad_accum or 1  # micro-batches per probe step; each loss is divided by it here

    def backward_step(self, losses: Sequence[Callable[[], torch.Tensor]]) -> None:
        """Accumulate the reduced gradient of one probe step: each callable computes one
        micro-batch's loss, whose backward runs before the next is computed (one graph alive)."""
        for loss in losses:
            (loss() / self.accum).backward()

    def computes_alone(self, params: Sequence[nn.Parameter]) -> bool:
        """Whether the gradients of `params` alone may be computed (`torch.autograd.grad`): whole,
        trainable weights held by this process (one process or DDP), not FSDP2's DTensors."""
        return all(p.requires_grad and not isinstance(p, DTensor) for p in params)

    def forward_sees_whole(self, params: Sequence[nn.Parameter]) -> bool:
        """Whether a forward through the module holding `params` computes with them whole, so that
        `torch.autograd.grad` of a loss of that forward returns their full gradients: true for
        plain tensors (one process, DDP, and ZeRO, whose stage 3 gathers a block's weights for its
        forward), false for FSDP2's DTensors, whose gradients only FSDP2's backward delivers."""
        return not any(isinstance(p, DTensor) for p in params)

    @contextlib.contextmanager
    def partial_backward(self, params: Sequence[nn.Parameter], comm: Collectives) -> Iterator[None]:
        """Around `torch.autograd.grad` of `params` (accumulated into their `.grad` by the caller):
        DDP's reducer would average inside `backward`; here its forward runs under `no_sync` and
        the gradients are averaged over ranks afterwards (divided, then summed, as DDP does)."""
        ddp = isinstance(self.model, DistributedDataParallel)
        with self.model.no_sync() if ddp else contextlib.nullcontext():
            yield
        if ddp and comm.distributed:
            for p in params:
                assert p.grad is not None
                p.grad.copy_(comm.all_reduce_sum(p.grad.div_(comm.world)))

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)


class DeepSpeedProbe(GradientProbe):
    """Probe backwards through a DeepSpeed engine: its backward divides by its own
    gradient_accumulation_steps, and the probe marks where a probe step ends."""

    def __init__(self, ds_engine: Any, grad_accum: int | None = None) -> None:
        super().__init__(ds_engine)
        self.ds = ds_engine
        gas = ds_engine.gradient_accumulation_steps()
        if grad_accum not in (None, gas):
            raise ValueError(f"grad_accum={grad_accum} differs from the DeepSpeed engine's gradient_accumulation_steps={gas}")
        self.accum = gas  # its own backward divides by it

    def backward_step(self, losses: Sequence[Callable[[], torch.Tensor]]) -> None:
        # Our probe steps are not the engine's optimizer steps, so its micro-step counter cannot
        # tell where they end: mark the boundary (the ZeRO-1/2 gradient reduction) ourselves, then
        # hand the decision back (the engine re-pushes it to its optimizer at every backward).
        saved = self.ds._is_gradient_accumulation_boundary
        try:
            for i, loss in enumerate(losses):
                self.ds.set_gradient_accumulation_boundary(i == len(losses) - 1)
                self.ds.backward(loss())
        finally:
            self.ds._is_gradient_accumulation_boundary = saved

    def computes_alone(self, params: Sequence[nn.Parameter]) -> bool:
        return False  # ZeRO reduces (and partitions) gradients inside its own backward hooks

    def zero_grad(self) -> None:
        opt = self.ds.optimizer
        if opt is not None and hasattr(opt, "zero_grad"):
            opt.zero_grad()
        else:
            self.ds.zero_grad()


def gradient_probe(model_or_engine: Any, grad_accum: int | None = None) -> GradientProbe:
    """The probe of a harness `Engine` (its own `gradient_probe`), a DeepSpeed engine, or a torch
    model, with `grad_accum` micro-batches per probe step (DeepSpeed: its own, checked)."""
    if not isinstance(model_or_engine, nn.Module) and hasattr(model_or_engine, "gradient_probe"):  # a harness Engine
        return model_or_engine.gradient_probe(grad_accum)
    if is_deepspeed_engine(model_or_engine):
        return DeepSpeedProbe(model_or_engine, grad_accum)
    return GradientProbe(model_or_engine, grad_accum)
