"""Per-step agreement on non-finite losses and stop requests, and the skip/stop policy.

Every decision is collective: a NaN on one rank, or a SIGTERM that reached one rank first,
is all-reduced so that every rank takes the same branch (skip, save, stop). Diverging
ranks are what turn a recoverable fault into a hang.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from harness.distributed import Collectives, DistInfo
from harness.engine import weights_finite
from harness.errors import NonFiniteError
from harness.log import get_logger
from harness.reliability.faults import install_fault_hooks
from harness.reliability.signals import on_memory_split_request, signal_received

log = get_logger(__name__)

_ACTIVE: dict[str, Any] = {"guard": None}  # the running guard, for the OOM report


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
        self.comm = Collectives()
        self.last_checkpoint = last_checkpoint
        self.start_step = self.steps_done = start_step
        self.stop_requested = False
        self.nonfinite_steps = 0
        self.consecutive = 0  # skipped steps in a row (the run is not training while this grows)
        self.max_consecutive = cfg.checkpoint.max_consecutive_skips
        self._bad_loss = False
        _ACTIVE["guard"] = self
        install_fault_hooks(engine.module, info.rank, lambda: self.steps_done)
        if tracker is not None and tracker.enabled:
            on_memory_split_request(tracker.request_split)

    def pre_step(self, local_loss: float) -> bool:
        """Before the optimizer step (collective): True when any rank's loss is non-finite: skip the update."""
        self._bad_loss, self.stop_requested = self.comm.any([not math.isfinite(local_loss), signal_received()])
        return self._bad_loss

    def post_step(self, result: Any) -> None:
        """After the step: apply the policy (skip: count and go on; stop: NonFiniteError)."""
        self.steps_done += 1
        step = self.steps_done
        # fp16: an inf gradient norm is the loss scaler's routine overflow, not a divergence.
        bad_norm = not math.isfinite(result.grad_norm) and not self.fp16
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
