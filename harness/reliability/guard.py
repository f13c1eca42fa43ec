"""Per-step agreement on non-finite losses and stop requests, and the skip/stop policy.

Every decision is collective: a NaN on one rank, or a SIGTERM that reached one rank first,
is all-reduced so that every rank takes the same branch (skip, save, stop). Diverging
ranks are what turn a recoverable fault into a hang.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.distributed import DistInfo
from harness.engine import Engine
from harness.errors import NonFiniteError
from harness.log import get_logger
from harness.reliability.faults import install_fault_hooks
from harness.reliability.signals import signal_received

log = get_logger(__name__)

_ACTIVE: dict[str, Any] = {"guard": None}  # the running guard, for the OOM report


def _all_true(flag: bool, info: DistInfo) -> bool:
    if not info.distributed or info.world_size == 1:
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int32, device=info.device if info.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) == 0


def weights_finite(engine: Engine, info: DistInfo) -> bool:
    """Whether every rank's weights are finite (collective)."""
    local = all(bool(torch.isfinite(t).all()) for t in engine.local_parameters())
    return _all_true(local, info)


class StepGuard:
    """Per-step agreement on non-finite losses and stop requests, and the skip/stop policy."""

    def __init__(
        self,
        cfg: Any,
        info: DistInfo,
        engine: Any,
        tracker: Any = None,
        last_checkpoint: Callable[[], str | None] = lambda: None,
        start_step: int = 0,
    ):
        self.policy = cfg.checkpoint.on_nonfinite
        self.fp16 = cfg.precision == "fp16"
        self.info, self.engine, self.tracker = info, engine, tracker
        self.last_checkpoint = last_checkpoint
        self.start_step = self.steps_done = start_step
        self.stop_requested = False
        self.nonfinite_steps = 0
        self._bad_loss = False
        _ACTIVE["guard"] = self
        install_fault_hooks(engine.module, info.rank, lambda: self.steps_done)

    def pre_step(self, local_loss: float) -> bool:
        """Before the optimizer step (collective): True when any rank's loss is non-finite: skip the update."""
        flags = torch.tensor([0.0 if math.isfinite(local_loss) else 1.0, 1.0 if signal_received() else 0.0])
        if self.info.distributed and self.info.world_size > 1:
            flags = flags.to(self.info.device if self.info.backend == "nccl" else "cpu")
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._bad_loss = bool(flags[0] > 0)
        self.stop_requested = bool(flags[1] > 0)
        return self._bad_loss

    def post_step(self, result: Any) -> None:
        """After the step: apply the policy (skip: count and go on; stop: NonFiniteError)."""
        self.steps_done += 1
        step = self.steps_done
        # fp16: an inf gradient norm is the loss scaler's routine overflow, not a divergence.
        bad_norm = not math.isfinite(result.grad_norm) and not self.fp16
        if not (self._bad_loss or bad_norm):
            return
        self.nonfinite_steps += 1
        what = "loss" if self._bad_loss else "gradient norm"
        last = self.last_checkpoint() or "none saved yet"
        applied = not result.skipped or self.engine.steps_in_backward  # the optimizer stepped inside backward already
        if applied and not weights_finite(self.engine, self.info):
            raise NonFiniteError(
                f"non-finite {what} at step {step} was applied to the weights (this engine cannot skip it); last good checkpoint: {last}"
            )
        if self.policy == "stop":
            raise NonFiniteError(
                f"non-finite {what} at step {step}; stopping (checkpoint.on_nonfinite=stop). "
                f"Last good checkpoint: {last} (resume with checkpoint.resume=<it>, e.g. with a lower optim.lr)"
            )
        log.info(f"step {step}: non-finite {what}; update skipped ({self.nonfinite_steps} so far, checkpoint.on_nonfinite=skip)")


def active_guard() -> StepGuard | None:
    """The guard of the run in progress (the OOM report reads its engine, tracker and step)."""
    return _ACTIVE["guard"]
