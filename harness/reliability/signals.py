"""Stop requests (SIGTERM/SIGUSR1, as SLURM sends before preemption): a flag, acted on at a step boundary.

The handler only records the signal; the step guard all-reduces it so every rank saves
and stops at the same step.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

_SIGNAL = {"received": None}


def _on_signal(signum: int, frame: Any) -> None:
    _SIGNAL["received"] = signum  # acted on at the next step boundary, by every rank together


def signal_received() -> bool:
    return _SIGNAL["received"] is not None


def install_signal_handlers() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, _on_signal)
