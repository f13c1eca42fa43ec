"""The supervisor of a run: exceptions out as one message and an exit code; dead ranks named.

- Out of memory: prints memory held by category and what the planner would change
  (`harness.reliability.oom`), then exits without waiting for the other ranks.
- Non-finite stop and checkpoint failures (raised on every rank alike, the decision was
  all-reduced): one line on rank 0, an agreed exit code (`harness.errors`).
- A dead rank: gloo raises at once on a closed peer socket, NCCL would hang; either way a
  heartbeat through the rendezvous store (`PeerMonitor`) names the rank that stopped and
  makes the others exit within `HARNESS_PEER_TIMEOUT_S` (default 30 s), long before the
  collective timeout (`HARNESS_COLLECTIVE_TIMEOUT_S`, the backstop for hung-but-alive ranks).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from harness.config import RunConfig
from harness.distributed import DistInfo, exit_process
from harness.errors import (
    EXIT_CHECKPOINT,
    EXIT_NONFINITE,
    EXIT_OOM,
    EXIT_PEER_LOST,
    CheckpointError,
    NonFiniteError,
    StopRequested,
    env_seconds,
)
from harness.reliability.guard import active_guard
from harness.reliability.oom import is_oom, oom_report
from harness.reliability.signals import install_signal_handlers


def collective_timeout_s() -> float:
    """The process group's collective timeout: the backstop for a rank that hangs while alive."""
    return env_seconds("HARNESS_COLLECTIVE_TIMEOUT_S", 600.0)


class PeerMonitor:
    """Heartbeats through the rendezvous store; names a rank that stopped and makes every rank exit.

    Each rank increments its counter every `interval` seconds and watches the next rank's
    (a ring: O(1) store traffic per rank). A counter that has not moved for `timeout`
    seconds means that rank died or hangs outside Python; the watcher posts the verdict
    in the store, and every rank's monitor, seeing it, prints it and exits.
    """

    def __init__(self, info: DistInfo, interval: float = 1.0, timeout: float | None = None):
        self.info = info
        self.interval = interval
        self.timeout = timeout if timeout is not None else env_seconds("HARNESS_PEER_TIMEOUT_S", 30.0)
        self.prefix = f"harness/hb/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.store = self._connect()
        self.agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harness-peer-monitor", daemon=True)

    def _connect(self) -> Any:
        """A store client of our own, with a short timeout, so a lost store fails fast and blocks nothing else."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if addr and port:
            try:
                return dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
            except Exception:
                pass
        return dist.distributed_c10d._get_default_store()

    def start(self) -> PeerMonitor:
        self._beat()
        self._thread.start()
        return self

    def stop(self, failure: str | None = None) -> None:
        """Stop beating; `failure`: this rank ends on an error of its own (a bug), which the peers'
        `probe` then names instead of their own collective's closed connection."""
        self._stop.set()
        try:
            if failure is not None:
                self.store.set(f"{self.prefix}failed/{self.info.rank}", failure)
            self.store.set(f"{self.prefix}done/{self.info.rank}", "1")
        except Exception:
            pass

    def _failed(self, peers: list[int], own: str | None) -> str | None:
        """A peer that ended on an error other than `own`: an error every rank raised alike (a
        refused input) is this rank's own to report, not a peer's failure."""
        for rank in peers:
            if self.store.check([f"{self.prefix}failed/{rank}"]):
                theirs = self.store.get(f"{self.prefix}failed/{rank}").decode()
                if theirs != own:
                    return f"rank {rank} failed ({theirs}; its traceback is in its output)"
        return None

    def _beat(self) -> int:
        return self.store.add(f"{self.prefix}{self.info.rank}", 1)

    def _count(self, rank: int) -> int:
        return self.store.add(f"{self.prefix}{rank}", 0)

    def _done(self, rank: int) -> bool:
        return self.store.check([f"{self.prefix}done/{rank}"])

    def _store_lost(self) -> str:
        host = "the torchrun agent of the first node" if self.agent_store else "rank 0"
        return (
            f"lost the rendezvous store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}, hosted by "
            f"{host}: {'it' if self.agent_store else 'rank 0'} died or its node is unreachable"
        )

    def _exit(self, message: str) -> None:
        print(f"harness: error: rank {self.info.rank}: {message}; exiting", file=sys.stderr, flush=True)
        exit_process(EXIT_PEER_LOST)

    def _run(self) -> None:
        peer = (self.info.rank + 1) % self.info.world_size
        last_count, last_change = -1, time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                if self.store.check([f"{self.prefix}dead"]):
                    self._exit(self.store.get(f"{self.prefix}dead").decode())
                count = self._count(peer)
                now = time.monotonic()
                if count != last_count:
                    last_count, last_change = count, now
                elif now - last_change > self.timeout and not self._done(peer):
                    verdict = f"rank {peer} died or hangs (no heartbeat for {now - last_change:.0f} s, noticed by rank {self.info.rank})"
                    self.store.set(f"{self.prefix}dead", verdict)
                    self._exit(verdict)
            except Exception:
                if self._stop.is_set():
                    return
                self._exit(self._store_lost())

    def probe(self, own: str | None = None) -> str | None:
        """After this rank's error `own` (a failed collective, or an error of its own): a peer that
        failed otherwise, or the ranks that stopped beating (a few intervals' watch), or None."""
        try:
            if self.store.check([f"{self.prefix}dead"]):
                return self.store.get(f"{self.prefix}dead").decode()
            peers = [r for r in range(self.info.world_size) if r != self.info.rank]
            first = {r: self._count(r) for r in peers}
            time.sleep(3 * self.interval)
            if (failed := self._failed(peers, own)) is not None:
                return failed
            dead = [r for r in peers if self._count(r) == first[r] and not self._done(r)]
        except Exception:
            return self._store_lost()
        if not dead:
            return None
        names = ", ".join(f"rank {r}" for r in dead)
        return f"{names} died (no heartbeat; a collective with {'it' if len(dead) == 1 else 'them'} failed)"


class Supervisor:
    """Wraps a run: signal handlers and peer monitor in; exceptions out as one message and an exit code.

    with Supervisor(cfg, info):
        train(...)
    """

    def __init__(self, cfg: RunConfig, info: DistInfo):
        self.cfg, self.info = cfg, info
        self.monitor: PeerMonitor | None = None

    def __enter__(self) -> Supervisor:
        install_signal_handlers()
        if self.info.distributed and self.info.world_size > 1:
            self.monitor = PeerMonitor(self.info).start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, (KeyboardInterrupt, SystemExit, StopRequested)):
            if self.monitor is not None:
                self.monitor.stop()
            return False
        if is_oom(exc):
            print(oom_report(exc, self.cfg, self.info, active_guard()), file=sys.stderr, flush=True)
            self._hard_exit(EXIT_OOM)
        if isinstance(exc, (NonFiniteError, CheckpointError)):
            # Raised on every rank alike (the decision was all-reduced): a clean, agreed exit.
            if self.monitor is not None:
                self.monitor.stop()
            if self.info.is_main:
                print(f"harness: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_NONFINITE if isinstance(exc, NonFiniteError) else EXIT_CHECKPOINT)
        if self.monitor is not None:
            own = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            verdict = self.monitor.probe(own)
            if verdict:
                print(
                    f"harness: error: rank {self.info.rank}: {verdict}; exiting ({own})",
                    file=sys.stderr,
                    flush=True,
                )
                self._hard_exit(EXIT_PEER_LOST)
            self.monitor.stop(failure=own)
        return False  # an ordinary bug: the traceback

    @staticmethod
    def _hard_exit(code: int) -> None:
        """Exit now: with a peer gone, process-group teardown and atexit handlers could block forever."""
        exit_process(code)
