"""Engines: one interface over torch (single/DDP/FSDP2) and DeepSpeed.

The training loop calls `forward_loss` and `backward` inside `micro_batch`, then `step`; the checkpointer calls
`save_state`/`load_state`; the memory report calls `state_bytes`; the failure guard calls
`local_parameters`. None of them asks which engine it has: whatever differs between
engines (DCP vs DeepSpeed's format, where ZeRO keeps its partitions, FSDP2's DTensors)
is answered here, by the engine that knows.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from harness.config import CheckpointFormat, EngineKind, RunConfig
from harness.distributed import DistInfo
from harness.engine.plan import EnginePlan
from harness.engine.probe import GradientProbe
from harness.engine.shard_base import ParamShard
from harness.engine.shards import memory_storage, shard_of
from harness.log import get_logger
from harness.memory import COMPILE, ActivationOffload, CompiledCheck, ModelStorage
from harness.models import ModelSpec, count_parameters, quantized_codes

LossFn = Callable[..., torch.Tensor]  # (model, batch, num_items=None) -> the micro-batch's loss


log = get_logger(__name__)


def _say_if_eager(compiled: CompiledCheck) -> None:
    line = compiled.fell_back()
    if line is not None:
        log.warning(line)


@dataclass
class StepResult:
    grad_norm: float | torch.Tensor  # a 0-dim device tensor, unread, after `Engine.grad_norm` (read it at log steps)
    skipped: bool  # the optimizer step did not happen (non-finite gradients / fp16 overflow)


class Engine:
    """Common surface; subclasses fill in the engine-specific parts.

    An engine is built whole from its `EnginePlan` (`build`: load the model its own way, wrap
    it, construct): nothing is set on it from outside after construction.
    """

    checkpoint_format: ClassVar[CheckpointFormat]  # the on-disk format of `save_state`: "torch" (DCP) | "deepspeed"
    sequence_split_by: ClassVar[str]  # whose Ulysses splits sequences under this engine, for the start-up line
    zero_stage: int = 0  # the ZeRO stage a checkpoint of this engine was partitioned at (DeepSpeed only)
    owns_grad_accumulation: ClassVar[bool] = False  # divides the loss by the accumulation steps itself (DeepSpeed)
    module: nn.Module  # the underlying HF model (for pruning, export, hooks)
    model: nn.Module  # what forward is called on

    def __init__(self, plan: EnginePlan, loss_fn: LossFn, grad_accum: int, device: torch.device, startup_s: dict[str, float]):
        self.plan = plan
        self.kind: EngineKind = plan.kind  # for reports and checkpoint metadata
        self.policy = plan.precision
        self.loss_fn = loss_fn
        self.grad_accum = grad_accum
        self.device = device
        self.activation_offload = plan.activation_offload  # saved activations go to host memory
        self.offload_checkpoint_inputs = plan.offload_checkpoint_inputs  # only the checkpointed blocks' inputs do
        # Checkpoints keep the trainable parameters only (LoRA: the adapters); see EnginePlan.trainable_only.
        self.trainable_only = plan.trainable_only
        self.startup_s = dict(startup_s)  # seconds spent loading the model and initialising the engine
        # `register_post_step_hook`'s, run by `step` (an OrderedDict: the handle keeps a weak reference to it)
        self._post_step_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self._offloader: ActivationOffload | None = None  # `_offload`'s, once built
        # the ranks holding slices of this rank's sequences (None: whole sequences), the one group every
        # consumer of the split uses (Ulysses' attention, the router's balance): a second group of the same
        # ranks would be a second communicator on a GPU
        self.sequence_group: dist.ProcessGroup | None = None
        # what must have happened in the first forward (Ulysses' exchange ran), checked once after it
        self._after_first_forward: list[Callable[[], None]] = []
        memory = plan.config.memory
        if COMPILE.is_on(memory):  # said, not refused: an eager fallback trains the same model, only slower
            compiled = CompiledCheck(memory.compile if memory.compile != "none" else "model")
            self._after_first_forward.append(lambda: _say_if_eager(compiled))

    @classmethod
    def build(cls, spec: ModelSpec, cfg: RunConfig, plan: EnginePlan, info: DistInfo, loss_fn: LossFn) -> Engine:
        """Load the model this engine's way (no rank holds more than its part), wrap it, and
        construct the engine, timing both phases (`startup_s`)."""
        raise NotImplementedError

    @classmethod
    def load_model(cls, spec: ModelSpec, cfg: RunConfig, plan: EnginePlan, info: DistInfo) -> nn.Module:
        """The load phase alone: the model built, its memory techniques applied, sharded where the
        engine shards, and filled."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optimizer-in-backward
    @property
    def steps_in_backward(self) -> bool:
        """Whether the optimizer already stepped inside backward (a step cannot be skipped after it)."""
        return False

    def backward_without_step(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes run inside do not step the optimizer (gradient probes, e.g. pruning)."""
        return contextlib.nullcontext()

    def gradient_probe(self, grad_accum: int | None = None) -> GradientProbe:
        """Backward passes that measure gradients without stepping (pruning's probes), run this
        engine's way: its accumulation boundaries, its wrapper's reduction. `grad_accum`: micro-
        batches per probe step (default this engine's)."""
        raise NotImplementedError

    def forward_loss(self, batch: torch.Tensor, num_items: float | None = None) -> torch.Tensor:
        """The loss of one micro-batch: its summed token losses over ``num_items`` (default: its
        own counted tokens, a mean). `backward` then averages over accumulation and ranks."""
        offload = self._offload() if torch.is_grad_enabled() else None
        with self.policy.autocast_context(self.device), offload if offload is not None else contextlib.nullcontext():
            loss = self.loss_fn(self.model, batch) if num_items is None else self.loss_fn(self.model, batch, num_items=num_items)
        while self._after_first_forward:
            self._after_first_forward.pop()()
        return loss

    def _offload(self) -> ActivationOffload | None:
        """The engine's one activation offload, built at the first training forward and entered by
        every one after it: its CUDA side stream (checkpoint inputs) is the engine's, so the device
        blocks allocated on it are reused from one micro-batch to the next, not left cached on a new
        stream each time. None when neither offload is on."""
        if self._offloader is None and (self.activation_offload or self.offload_checkpoint_inputs):
            if self.activation_offload:
                self._offloader = ActivationOffload()
            else:
                self._offloader = ActivationOffload(scope="checkpoint_inputs", model=self.model)
        return self._offloader

    @torch.no_grad()
    def eval_loss_sum(self, batch: torch.Tensor) -> torch.Tensor:
        """The summed token losses of `batch` (its counted tokens: `harness.training.count_targets`)."""
        return self.forward_loss(batch, num_items=1.0)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def num_parameters(self) -> int:
        """Parameters of the whole model, however they are sharded (a quantized weight: the weights it encodes)."""
        return count_parameters(self.module)

    def shards(self) -> list[ParamShard]:
        """This rank's part of every parameter (name, range, working/master/gradient views, `write`),
        however this engine stores it: what pruning, masks and reports read instead of the storage."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return [shard_of(p, name, world) for name, p in self.module.named_parameters()]

    def memory_storage(self) -> ModelStorage:
        """What the memory tracker of `model` must be told about how this engine stores it."""
        return memory_storage(self.model)

    def local_parameters(self) -> list[torch.Tensor]:
        """The weights this rank holds (its shard where the engine shards), detached; numbers only
        (a quantized base's packed codes are bit patterns, which may read as NaN)."""
        codes = quantized_codes(self.model)
        return [p.detach() for p in self.model.parameters() if p.numel() and id(p) not in codes]

    def register_post_step_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Run `hook` after every optimizer step (pruning's mask enforcer keeps pruned weights at
        zero); `handle.remove()` ends it. A torch optimizer runs it from its own step post-hook, so
        any step of it is covered; other optimizers (DeepSpeed's, optimizer-in-backward's) have
        no such hook, and `step` runs it once the training step is done, skipped or not."""
        optimizer = self.optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer.register_step_post_hook(lambda *_: hook())
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    def _run_post_step_hooks(self) -> None:
        """Called by each engine's `step` as its last action."""
        for hook in list(self._post_step_hooks.values()):
            hook()

    # ------------------------------------------------------------------ engine-specific
    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Entered around one micro-batch's `forward_loss` and `backward(loss, last_micro=last)`:
        only the step's last micro-batch reduces gradients over ranks, the others accumulate
        locally. It covers the forward because DDP decides there whether the backward all-reduces
        (`DistributedDataParallel.no_sync`); a `backward(loss, last_micro=False)` outside it still
        accumulates the right gradients, but under DDP all-reduces them too."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        raise NotImplementedError

    def grad_norm(self) -> torch.Tensor | None:
        """Before `step`: finish this step's gradients (unscale, clip) and return their global norm
        as a 0-dim tensor on the device, unread, so the caller can fold its finiteness into the
        step's one agreement (`harness.reliability.StepGuard.agree`). After it, `step(skip)`
        trusts `skip` to carry that finiteness and does not read the norm itself. None where the
        engine measures the norm inside its own step (DeepSpeed, optimizer-in-backward)."""
        return None

    def step(self, skip: bool = False) -> StepResult:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        raise NotImplementedError

    @property
    def optimizer(self) -> Any:
        raise NotImplementedError

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, fp32 masters, gradients and optimizer state this rank holds
        (`harness.memory.categories.STATE_CATEGORIES`): the proof of sharding."""
        raise NotImplementedError

    def save_state(self, directory: str) -> None:
        """Write model and optimizer state under `directory`, each rank only its own shards (collective)."""
        raise NotImplementedError

    def load_state(self, directory: str, saved_world_size: int, is_main: bool) -> None:
        """Load what `save_state` wrote, resharding when it was written at another world size (collective)."""
        raise NotImplementedError

    def trainer_state(self) -> dict[str, Any]:
        """Small state the engine's own format does not keep (schedulers, loss scaler); same on every rank."""
        return {}

    def lr_schedulers(self) -> list[Any]:
        """The LR schedulers this engine steps (harness's `LambdaLR`s; a DeepSpeed file's own scheduler is not one)."""
        return []

    def rebase_lr(self, lr: float) -> bool:
        """A resumed run's new `optim.lr`: the restored schedule continues from its step at the new
        peak rate (the schedule's state holds the old one). False when this engine's schedule is
        not harness's (a DeepSpeed file's scheduler) and so cannot be rebased."""
        schedulers = self.lr_schedulers()
        if not schedulers or not all(isinstance(s, torch.optim.lr_scheduler.LambdaLR) for s in schedulers):
            return False
        for sched in schedulers:
            sched.base_lrs = [lr for _ in sched.base_lrs]
            for group, factor in zip(sched.optimizer.param_groups, sched.lr_lambdas):
                group["initial_lr"] = lr
                group["lr"] = lr * factor(sched.last_epoch)
            sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]
        return True

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Restore what `trainer_state` returned."""
