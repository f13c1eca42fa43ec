"""Per-step agreement on non-finite losses and stop requests, and the skip/stop policy.

Every decision is collective: a NaN on one rank, or a SIGTERM that reached one rank first,
is all-reduced so that every rank takes the same branch (skip, save, stop). Diverging
ranks are what turn a recoverable fault into a hang.

The agreement is the step's one host sync: the loss (summed on the device over the
micro-batches), the gradient norm's finiteness and the stop request travel in one small
tensor, all-reduced on the device and read once, before the optimizer step. Nothing else
in a step waits for the device (the logged values are read at log steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harness.config import CheckpointConfig
from harness.distributed import Collectives, DistInfo
from harness.engine import Engine, weights_finite
from harness.errors import NonFiniteError
from harness.log import get_logger
from harness.memory import StepMemoryTracker
from harness.reliability.faults import install_fault_hooks
from harness.reliability.signals import on_memory_split_request, signal_received

log = get_logger(__name__)

_ACTIVE: dict[str, Any] = {"guard": None}  # the running guard, for the OOM report


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed on before the optimizer step."""

    skip: bool  # some rank's loss, or the gradient norm, is non-finite: drop the update
    loss: float  # the step's loss, averaged over ranks
    extra: tuple[float, ...] = ()  # `agree`'s `extra`, summed over ranks (the router's aux loss and expert counts)


class StepGuard:
    """Per-step agreement on non-finite losses and stop requests, and the skip/stop policy."""

    def __init__(
        self,
        checkpoint: CheckpointConfig,
        info: DistInfo,
        engine: Engine,
        tracker: StepMemoryTracker | None = None,
        last_checkpoint: Callable[[], str | None] = lambda: None,
        start_step: int = 0,
    ):
        """Its policy is the checkpoint section's (`on_nonfinite`, `max_consecutive_skips`); the
        engine's precision says whether an inf gradient norm is a loss scaler's overflow."""
        self.policy = checkpoint.on_nonfinite
        self.fp16 = engine.plan.precision.uses_scaler
        self.info, self.engine, self.tracker = info, engine, tracker
        self.comm = Collectives()
        self.last_checkpoint = last_checkpoint
        self.start_step = self.steps_done = start_step
        self.stop_requested = False
        self.nonfinite_steps = 0
        self.consecutive = 0  # skipped steps in a row (the run is not training while this grows)
        self.max_consecutive = checkpoint.max_consecutive_skips
        self._bad_loss = False
        self._bad_norm: bool | None = None  # agreed before the step; None: the engine measured its norm in its step
        _ACTIVE["guard"] = self
        install_fault_hooks(engine.module, info.rank, lambda: self.steps_done)
        if tracker is not None and tracker.enabled:
            on_memory_split_request(tracker.request_split)

    def agree(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None, extra: torch.Tensor | None = None) -> Agreement:
        """Before the optimizer step (collective, the step's one host sync): whether any rank's
        loss (`loss_sum`, this rank's micro-batch losses summed on the device) or the gradient
        norm (global, from `Engine.grad_norm`; None where the engine measures it in its step) is
        non-finite, whether a stop was requested on any rank, and the loss averaged over ranks.
        `extra`: more values of this rank's step to sum over ranks in the same sync (a 1-d tensor on
        the device: the router's aux loss and expert counts, `harness.training.RouterLoss.pop`).

        One float64 tensor [loss non-finite, stop, norm non-finite, loss, *extra] summed over ranks:
        a flag summed is nonzero where any rank raised it, and the loss sum is exact in float64."""
        n_extra = 0 if extra is None else extra.numel()
        wire = torch.zeros(4 + n_extra, dtype=torch.float64, device=loss_sum.device)
        wire[0] = (~torch.isfinite(loss_sum)).double()
        if signal_received():
            wire[1] = 1.0
        if grad_norm is not None:
            wire[2] = (~torch.isfinite(grad_norm.detach())).double()
        wire[3] = loss_sum.detach().double()
        if extra is not None:
            wire[4:] = extra.detach().to(wire.device, torch.float64).reshape(-1)
        bad_loss, stop, bad_norm, total, *summed = self.comm.all_reduce_sum(wire).tolist()
        self._bad_loss, self.stop_requested = bad_loss > 0, stop > 0
        self._bad_norm = None if grad_norm is None else bad_norm > 0
        return Agreement(skip=self._bad_loss or bool(self._bad_norm), loss=total / self.comm.world, extra=tuple(summed))

    def post_step(self, result: Any) -> None:
        """After the step: apply the policy (skip: count and go on; stop: NonFiniteError)."""
        self.steps_done += 1
        step = self.steps_done
        # fp16: an inf gradient norm is the loss scaler's routine overflow, not a divergence.
        agreed, self._bad_norm = self._bad_norm, None
        bad_norm = (agreed if agreed is not None else not math.isfinite(result.grad_norm)) and not self.fp16
        if not (self._bad_loss or bad_norm):
            self.consecutive = 0
            return
        self.nonfinite_steps += 1
        self.consecutive += 1
        what = "loss" if self._bad_loss else "gradient norm"
        last = self.last_checkpoint() or "none saved yet"
        applied = not result.skipped or self.engine.steps_in_backward  # the optimizer stepped inside backward already
        if applied and not weights_finite(self.engine, self.comm):
            raise NonFiniteError(
                f"non-finite {what} at step {step} was applied to the weights (this engine cannot skip it); last good checkpoint: {last}"
            )
        if self.policy == "stop":
            raise NonFiniteError(
                f"non-finite {what} at step {step}; stopping (checkpoint.on_nonfinite=stop). "
                f"Last good checkpoint: {last} (resume with checkpoint.resume=<it>, e.g. with a lower optim.lr)"
            )
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"non-finite {what} in {self.consecutive} consecutive steps ({step - self.consecutive + 1}-{step}): every update was "
                f"skipped, the model is not training (checkpoint.max_consecutive_skips={self.max_consecutive}). Last good checkpoint: "
                f"{last} (resume with checkpoint.resume=<it> and a lower optim.lr)"
            )
        if self.info.is_main:  # every rank skipped the same step (agreed): one warning
            log.warning(f"step {step}: non-finite {what}; update skipped ({self.nonfinite_steps} so far, checkpoint.on_nonfinite=skip)")

    def finish(self, steps_run: int) -> None:
        """At the end of a run: a run none of whose steps updated the weights did not train (exit 3)."""
        if steps_run > 0 and self.consecutive >= steps_run:
            raise NonFiniteError(
                f"every one of this run's {steps_run} steps had a non-finite loss or gradient and was skipped: the model did not "
                f"train. Last good checkpoint: {self.last_checkpoint() or 'none saved yet'} (resume from it with a lower optim.lr)"
            )


def active_guard() -> StepGuard | None:
    """The guard of the run in progress (the OOM report reads its engine, tracker and step)."""
    return _ACTIVE["guard"]
