"""Fault injection's forward hook: the faults of a training step (`nan_loss`, `oom`, `signal`, `kill`, `error`),
as `HARNESS_FAULT` asks for them (the spec and its parsing: `harness.faults`)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import torch

from harness.faults import fault_step
from harness.reliability.signals import signal_received


def install_fault_hooks(module: torch.nn.Module, rank: int, steps_done: Callable[[], int]) -> None:
    """A forward hook on the LM head that injects the requested fault in one training step
    (`steps_done()`: the steps this run has finished, so the hook knows which step it is in)."""
    nan_step, oom_step, signal_step = fault_step("nan_loss", rank), fault_step("oom", rank), fault_step("signal", rank)
    kill_step, error_step = fault_step("kill", rank), fault_step("error", rank)
    if all(step is None for step in (nan_step, oom_step, signal_step, kill_step, error_step)):
        return
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is None:
        raise RuntimeError("HARNESS_FAULT needs a model with an output embedding (LM head)")

    def hook(mod: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        step = steps_done() + 1
        if not mod.training:
            return output
        if step == kill_step:  # a worker lost as a node or the OOM killer would lose it: no handler runs
            os.kill(os.getpid(), signal.SIGKILL)
        if step == signal_step and not signal_received():  # as SLURM would: a real SIGUSR1 to this process
            os.kill(os.getpid(), signal.SIGUSR1)
        if step == oom_step:
            raise torch.OutOfMemoryError(f"injected by HARNESS_FAULT=oom@{oom_step}: tried to allocate the LM-head output")
        if step == error_step:  # a bug: an exception no handler knows, on this rank alone
            raise RuntimeError(f"injected by HARNESS_FAULT=error@{error_step}: an unexpected error in the forward")
        if step == nan_step:
            return output * float("nan")
        return output

    head.register_forward_hook(hook)
