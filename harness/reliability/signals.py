"""Stop requests (SIGTERM/SIGUSR1, as SLURM sends before preemption, and Ctrl-C), honoured in every phase.

A run has two halves, and a stop means something different in each:

- **Before the first step** (checking the config, joining the process group, waiting for an
  extension build lock, preparing data, loading and sharding the model): there is nothing to
  save, so a stop ends the run at once. The handler raises `StopRequested` naming the phase;
  the command prints one line and exits 0 (`harness.errors`), on every rank that got the
  signal. Python runs the handler wherever the main thread is, a finalizer included (a weakref
  callback, a `__del__`), and swallows what a finalizer raises: the stop is then sent again, to
  be raised where the main thread goes next (`_rearm_swallowed_stop`). A main thread blocked
  inside C (a rendezvous, a collective waiting for a peer) runs no Python handler until the
  call returns, so a watcher thread reads the signal from
  `signal.set_wakeup_fd` and, if the main thread has not left within `HARNESS_STOP_GRACE_S`
  (5 s), prints the same line and exits the process with 0 itself.
- **Once steps run** (training, pruning, fine-tuning, the final save): the handler only records
  the signal; the step guard (or the pruning's calibration loop) all-reduces it so every rank
  saves and stops at the same step. A second Ctrl-C aborts without a checkpoint.

SIGUSR2 asks for the next step's memory split by category
(`harness.memory.StepMemoryTracker.request_split`): per rank, no collective needed.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from harness.errors import EXIT_OK, StopRequested, env_seconds
from harness.log import ALL_RANKS, get_logger

log = get_logger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# phase: what runs before the first step, None once steps run; unraisablehook: the one stop_requests replaced
_SIGNAL: dict[str, Any] = {"received": None, "phase": None, "unraisablehook": sys.__unraisablehook__}


def _on_signal(signum: int, frame: Any) -> None:
    phase = _SIGNAL["phase"]
    if phase is not None:  # nothing to save yet: stop now, not at a step boundary that is minutes away
        _SIGNAL["received"] = signum
        raise StopRequested(stop_line(signum, phase))
    if signum == signal.SIGINT:
        if _SIGNAL["received"] == signal.SIGINT:  # a second Ctrl-C: the user will not wait for the step to end
            raise KeyboardInterrupt
        os.write(2, b"[harness] Ctrl-C: stopping at the next step boundary with a checkpoint (Ctrl-C again to abort without one)\n")
    _SIGNAL["received"] = signum  # acted on at the next step boundary, by every rank together


def _rearm_swallowed_stop(unraisable: Any) -> None:
    """`sys.unraisablehook` while stop requests are honoured: the handler's exception raised inside a
    finalizer is discarded by Python (printed as "Exception ignored in"), which would lose the stop.
    The signal is sent again instead, from a new thread once this hook has returned (sent from the
    main thread, Python would run the handler at once, still inside the finalizer): the handler then
    runs where the main thread goes next and raises there. Anything else goes to the previous hook."""
    signum = _SIGNAL["received"]
    ours = unraisable.exc_type is StopRequested or (unraisable.exc_type is KeyboardInterrupt and signum == signal.SIGINT)
    if ours and signum is not None:
        _thread.start_new_thread(_send_again, (signum,))  # not threading.Thread: its start() waits on the main thread
        return
    _SIGNAL["unraisablehook"](unraisable)


def _send_again(signum: int, after_s: float = 0.01) -> None:
    time.sleep(after_s)
    if _SIGNAL["received"] == signum:  # still this run's stop, not a later caller's handlers
        os.kill(os.getpid(), signum)


def stop_line(signum: int, phase: str) -> str:
    return f"stop requested ({signal.Signals(signum).name}) while {phase}; no step has run, so there is nothing to save"


def signal_received() -> bool:
    return _SIGNAL["received"] is not None


def entering(phase: str) -> None:
    """Name the phase before the first step that runs now (said if a stop ends it); ignored once steps run."""
    if _SIGNAL["phase"] is not None:
        _SIGNAL["phase"] = phase


def steps_begin() -> None:
    """From here a stop is acted on at a step boundary (with a checkpoint), never at once."""
    _SIGNAL["phase"] = None


def steps_discarded(phase: str) -> None:
    """Steps that ran are not kept (the check's reference): a stop ends the command at once again, naming `phase`."""
    _SIGNAL["phase"] = phase


def install_signal_handlers() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _on_signal)


class _BlockedMainWatch:
    """Sees a stop signal even while the main thread is blocked in C, where no Python handler runs
    (module doc); ends the process if the main thread has not acted on it within the grace."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.done = threading.Event()
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.previous_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._watch, name="harness-stop-watch", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set():
            try:
                data = self.reader.recv(64)
            except OSError:
                return
            if not data:
                return
            stops = [s for s in data if s in STOP_SIGNALS]
            phase = _SIGNAL["phase"]
            if stops and phase is not None and not self.done.wait(self.grace_s):
                line = stop_line(stops[0], phase)
                log.info(f"{line} (the wait did not return within {self.grace_s:g} s); exiting", extra=ALL_RANKS)
                os._exit(EXIT_OK)

    def close(self) -> None:
        self.done.set()
        signal.set_wakeup_fd(self.previous_fd)
        self.writer.close()
        with contextlib.suppress(OSError):
            self.reader.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=1.0)
        self.reader.close()


@contextlib.contextmanager
def stop_requests(phase: str = "starting") -> Iterator[None]:
    """A command's whole run (`harness.runner.run_command`): stop signals end it at once until
    `steps_begin`, then at a step boundary. The process's previous handlers, wakeup fd and state are
    restored on exit, so an in-process caller (a test, a notebook) is left as it was."""
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield
        return
    grace_s = env_seconds("HARNESS_STOP_GRACE_S", 5.0)
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    saved_state = dict(_SIGNAL)
    _SIGNAL.update(received=None, phase=phase, unraisablehook=sys.unraisablehook)
    install_signal_handlers()
    sys.unraisablehook = _rearm_swallowed_stop
    watch = _BlockedMainWatch(grace_s)
    try:
        yield
    finally:
        watch.close()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        sys.unraisablehook = _SIGNAL["unraisablehook"]
        _SIGNAL.update(saved_state)


def on_memory_split_request(request: Callable[[], None]) -> None:
    """SIGUSR2 (`kill -USR2 <pid>`, `scancel --signal=USR2`) calls `request`, which must only set a flag."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, lambda signum, frame: request())
