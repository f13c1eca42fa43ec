"""Stop requests (SIGTERM/SIGUSR1, as SLURM sends before preemption, and Ctrl-C): a flag, acted on at a step boundary.

The handler only records the signal; the step guard all-reduces it so every rank saves
and stops at the same step. SIGUSR2 asks for the next step's memory split by category
(`harness.memory.StepMemoryTracker.request_split`): per rank, no collective needed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

_SIGNAL = {"received": None}


def _on_signal(signum: int, frame: Any) -> None:
    if signum == signal.SIGINT:
        if _SIGNAL["received"] == signal.SIGINT:  # a second Ctrl-C: the user will not wait for the step to end
            raise KeyboardInterrupt
        os.write(2, b"[harness] Ctrl-C: stopping at the next step boundary with a checkpoint (Ctrl-C again to abort without one)\n")
    _SIGNAL["received"] = signum  # acted on at the next step boundary, by every rank together


def signal_received() -> bool:
    return _SIGNAL["received"] is not None


def install_signal_handlers() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, _on_signal)


def on_memory_split_request(request: Callable[[], None]) -> None:
    """SIGUSR2 (`kill -USR2 <pid>`, `scancel --signal=USR2`) calls `request`, which must only set a flag."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, lambda signum, frame: request())
