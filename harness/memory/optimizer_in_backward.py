"""Optimizer step fused into backward: each parameter steps as soon as its gradient is final.

A normal step keeps every gradient alive from its creation in backward until
``optimizer.step()``: the gradient peak is the size of the model. Here every parameter
gets its own optimizer and a ``register_post_accumulate_grad_hook`` that steps it and
frees its ``.grad`` immediately, so at most a few gradients are alive at any time.

Composition:

- FSDP2: build this *after* ``fully_shard`` so the hooks sit on the sharded DTensor
  parameters. FSDP2 calls those hooks itself after the reduce-scatter has written the
  sharded gradient (``foreach_reduce``), so each step sees the synchronised shard. The
  sharded gradients of one FSDP group are views of one reduce-scatter output, which is
  freed when the group's last gradient is dropped: the gradient peak is one block's
  shards, not one parameter's.
- Gradient accumulation: hooks step only on the last micro-batch
  (``with oib.micro_batch(last=...)``); earlier micro-batches accumulate into ``.grad``
  as usual (so the saving applies to the last backward; during accumulation the
  gradients are resident, as they must be). With FSDP2 ``set_requires_gradient_sync(False)``
  on earlier micro-batches also works: FSDP2 then calls the hooks only after the last
  reduce-scatter.
- LR schedules: one scheduler per optimizer (:meth:`make_schedulers`) or one value for
  all (:meth:`set_lr`).
- Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` go through DCP's
  ``get/set_optimizer_state_dict`` over all per-parameter optimizers, which keys state by
  parameter FQN - the same format a single optimizer over the same model produces.

Not possible, and rejected by :func:`check_optimizer_in_backward`: global-norm gradient
clipping (the norm needs every gradient, the first step runs before the last gradient
exists); the fp16 loss scaler (it must check all gradients for inf before any step);
DeepSpeed (it owns the optimizer step); DDP with world > 1 (post-accumulate hooks fire
before DDP's bucketed all-reduce, so a step would apply the unsynchronised local
gradient, and DDP's buckets keep every gradient allocated anyway).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from harness.config import OptimConfig
from harness.distributed import local_tensor
from harness.training import build_optimizer, build_scheduler

OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]


class OptimizerInBackward:
    """Per-parameter optimizers stepped from post-accumulate-grad hooks.

    ``optim``: a factory ``make_optimizer([p])`` building the optimizer of one parameter,
    or an ``OptimConfig`` (then ``harness.training.build_optimizer`` is the factory, and with
    ``total_steps`` :attr:`scheduler` is the run's schedule on every optimizer).
    ``self.names[p]`` is the parameter's FQN, for factories that decide weight decay by name.

    The trainer loop becomes::

        for i, batch in enumerate(micro_batches):
            oib.set_last_micro_batch(i == len(micro_batches) - 1)   # or: with oib.micro_batch(last=...)
            loss.backward()               # the last backward also steps every parameter
        oib.last_grad_norm()              # the norm of the gradients the steps used (for logs)
        scheduler.step()

    Non-finite gradients cannot cancel the step: parameters step as their gradients
    arrive. Check the loss before calling backward; :meth:`last_grad_norm` reports inf/nan
    afterwards so the step can be counted as bad.
    """

    def __init__(self, model: nn.Module, optim: OptimizerFactory | OptimConfig, total_steps: int | None = None) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError("optimizer-in-backward cannot wrap a DDP model: its hooks fire before DDP's all-reduce (use FSDP2)")
        if isinstance(optim, OptimConfig):
            config = optim
            make_optimizer: OptimizerFactory = lambda params: build_optimizer(params, config)
        else:
            make_optimizer = optim
        self.model = model
        self.names: dict[nn.Parameter, str] = {}
        self.optimizers: dict[nn.Parameter, Optimizer] = {}
        self._handles = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            self.names[param] = name
            self.optimizers[param] = make_optimizer([param])
            self._handles.append(param.register_post_accumulate_grad_hook(self._hook))
        if not self.optimizers:
            raise ValueError("optimizer-in-backward: the model has no trainable parameters")
        self._stepping = True
        self.steps_in_last_backward = 0
        self._sq_sum: torch.Tensor | None = None  # sum of squared gradient entries seen by this step's hooks
        first = next(iter(self.optimizers))
        # FSDP2 parameters are DTensors: each rank sees its shards, the norm needs an all-reduce.
        self._sharded = isinstance(first, DTensor)
        self._device = local_tensor(first).device
        self.scheduler: SchedulerGroup | None = None
        if isinstance(optim, OptimConfig) and total_steps is not None:
            self.scheduler = self.make_schedulers(lambda o: build_scheduler(o, optim, total_steps))

    # ------------------------------------------------------------------ the hook
    def _hook(self, param: nn.Parameter) -> None:
        if not self._stepping:
            return  # an earlier micro-batch: let the gradient accumulate
        grad = param.grad
        local = local_tensor(grad)
        # One fused reduction accumulating in fp32: no fp32 copy of a bf16 gradient.
        sq = torch.linalg.vector_norm(local.detach(), dtype=torch.float32).square()
        self._sq_sum = sq if self._sq_sum is None else self._sq_sum + sq
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.steps_in_last_backward += 1

    def set_last_micro_batch(self, last: bool) -> None:
        """Declare whether the next backward is the step's last micro-batch (only that one steps)."""
        self._stepping = last
        self.steps_in_last_backward = 0  # parameters stepped in the next backward (a check for loops)
        if last:
            self._sq_sum = None

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Run one micro-batch's backward inside this; only ``last=True`` steps the parameters."""
        previous = self._stepping
        self.set_last_micro_batch(last)
        try:
            yield
        finally:
            self._stepping = previous

    def last_grad_norm(self) -> float:
        """Global L2 norm of the gradients the last step applied (FSDP2: shards summed over ranks).

        Collective under FSDP2: call it on every rank.
        """
        sq = torch.zeros((), device=self._device) if self._sq_sum is None else self._sq_sum.detach().clone()
        if self._sharded and dist.is_available() and dist.is_initialized():
            dist.all_reduce(sq)
        return math.sqrt(float(sq))

    # ------------------------------------------------------- optimizer-like surface
    def step(self) -> None:
        """Nothing to do: the parameters stepped during backward. Present so loops need no branch."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients that no hook consumed (e.g. after a skipped step); accumulating gradients live in ``.grad``."""
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every per-parameter optimizer's groups (the live dicts: setting ``lr`` here takes effect)."""
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def set_lr(self, lr: float) -> None:
        """Set one learning rate on every parameter (the shared-LR alternative to per-optimizer schedulers)."""
        for group in self.param_groups:
            group["lr"] = lr

    def make_schedulers(self, make_scheduler: Callable[[Optimizer], Any]) -> SchedulerGroup:
        """One scheduler per optimizer, built by the trainer's own factory, stepped together."""
        return SchedulerGroup([make_scheduler(optimizer) for optimizer in self.optimizers.values()])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """FQN-keyed optimizer state of all parameters (DCP format; DTensor shards under FSDP2)."""
        return get_optimizer_state_dict(self.model, list(self.optimizers.values()))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, list(self.optimizers.values()), state_dict)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class SchedulerGroup:
    """Several LR schedulers driven as one (one per per-parameter optimizer)."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        # One entry per scheduler: base LRs may differ between parameters.
        return {"schedulers": [scheduler.state_dict() for scheduler in self.schedulers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict["schedulers"]
        if len(states) != len(self.schedulers):
            raise ValueError(f"scheduler state has {len(states)} entries, this run has {len(self.schedulers)} optimizers")
        for scheduler, state in zip(self.schedulers, states):
            scheduler.load_state_dict(state)


__all__ = ["OptimizerInBackward", "SchedulerGroup"]
