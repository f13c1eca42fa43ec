"""Fault injection for tests and drills (`HARNESS_FAULT`, comma-separated).

`nan_loss@STEP[:RANK]` (the LM head's output becomes NaN in that step's forward),
`oom@STEP[:RANK]` (a real `torch.OutOfMemoryError` raised in that step's forward),
`signal@STEP[:RANK]` (the process sends itself SIGUSR1 in that step's forward),
`save_pause=SECONDS[@STEP]` (a checkpoint is fully written but not committed for that long, or
until the file named by `HARNESS_FAULT_RELEASE` exists: a test ends the window when done with it),
`save_error@STEP[:RANK]` (writing that step's checkpoint fails as a full disk would: ENOSPC).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from harness.reliability.signals import signal_received


def _faults() -> list[tuple[str, str, int | None, int | None]]:
    """(name, value, step, rank) of each `name@STEP[:RANK]` or `name=VALUE[@STEP]` in HARNESS_FAULT."""
    out = []
    for item in filter(None, (s.strip() for s in os.environ.get("HARNESS_FAULT", "").split(","))):
        name, eq, rest = item.partition("=")
        if eq:  # name=VALUE[@STEP]
            value, _, step = rest.partition("@")
            out.append((name, value, int(step) if step else None, None))
        else:  # name@STEP[:RANK]
            name, _, where = item.partition("@")
            step, _, rank = where.partition(":")
            out.append((name, "", int(step), int(rank) if rank else None))
    return out


def fault_seconds(name: str, step: int) -> float:
    """Seconds of an injected pause at `step` (`save_pause=5` or `save_pause=5@4`); 0 when not injected."""
    for fname, value, fstep, _ in _faults():
        if fname == name and fstep in (None, step):
            return float(value)
    return 0.0


def hold(seconds: float) -> None:
    """Sleep `seconds`, or until the file named by HARNESS_FAULT_RELEASE (if set) exists."""
    release = os.environ.get("HARNESS_FAULT_RELEASE")
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0 and not (release and os.path.exists(release)):
        time.sleep(min(left, 0.1) if release else left)


def fault_step(name: str, rank: int) -> int | None:
    """The step at which fault `name` (`name@STEP[:RANK]`) is injected on `rank`, or None."""
    for fname, _, step, frank in _faults():
        if fname == name and frank in (None, rank):
            return step
    return None


def install_fault_hooks(module: torch.nn.Module, rank: int, steps_done: Callable[[], int]) -> None:
    """A forward hook on the LM head that injects the requested fault in one training step
    (`steps_done()`: the steps this run has finished, so the hook knows which step it is in)."""
    nan_step, oom_step, signal_step = fault_step("nan_loss", rank), fault_step("oom", rank), fault_step("signal", rank)
    if nan_step is None and oom_step is None and signal_step is None:
        return
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is None:
        raise RuntimeError("HARNESS_FAULT needs a model with an output embedding (LM head)")

    def hook(mod: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        step = steps_done() + 1
        if not mod.training:
            return output
        if step == signal_step and not signal_received():  # as SLURM would: a real SIGUSR1 to this process
            os.kill(os.getpid(), signal.SIGUSR1)
        if step == oom_step:
            raise torch.OutOfMemoryError(f"injected by HARNESS_FAULT=oom@{oom_step}: tried to allocate the LM-head output")
        if step == nan_step:
            return output * float("nan")
        return output

    head.register_forward_hook(hook)
