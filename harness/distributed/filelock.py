"""A lock file on a (possibly shared) file system that survives a crash of its owner.

Taken by creating the file exclusively (`O_EXCL`: atomic on local disks and on NFS/Lustre),
holding `{host, pid, started, what}`; a heartbeat thread refreshes its mtime while the owner
lives. A lock is dead when its owner is a process on this host that no longer exists, or
when its heartbeat is older than `HARNESS_LOCK_STALE_S` (default 120 s; the only test that
works across hosts). A dead lock is taken over once: the waiter that creates a takeover
token named after the dead owner removes it, and only while it is still that owner's, so
a lock taken meanwhile by a live process is never removed by a waiter that saw the old one.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import threading
import time
from typing import Any

from harness.errors import env_seconds

HEARTBEAT_S = 5.0
UNREADABLE_GRACE_S = 10.0  # an owner killed between creating the file and writing it


def stale_after_s() -> float:
    return env_seconds("HARNESS_LOCK_STALE_S", 120.0)


class FileLock:
    def __init__(self, path: str, what: str = "") -> None:
        self.path = path
        self.what = what
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ reading
    def owner(self) -> dict[str, Any]:
        """The owner's record ({} when there is no lock or it cannot be read yet)."""
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def heartbeat_age_s(self) -> float | None:
        try:
            return time.time() - os.stat(self.path).st_mtime
        except OSError:  # no lock (or its directory is not one)
            return None

    def dead_owner(self) -> dict[str, Any] | None:
        """The owner if it is dead; None while it lives (or when there is no lock)."""
        owner = self.owner()
        age = self.heartbeat_age_s()
        if age is None:
            return None
        if not owner:
            return {} if age > UNREADABLE_GRACE_S else None
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
            try:
                os.kill(owner["pid"], 0)
            except ProcessLookupError:
                return owner
            except PermissionError:
                pass
        return owner if age > stale_after_s() else None

    def describe(self, owner: dict[str, Any] | None = None) -> str:
        """'pid 123 on host h (what), started 12:01:02, heartbeat 3 s ago'."""
        owner = self.owner() if owner is None else owner
        age = self.heartbeat_age_s()
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["started"])) if owner.get("started") else "?"
        what = f" ({owner['what']})" if owner.get("what") else ""
        beat = f", heartbeat {age:.0f} s ago" if age is not None else ""
        return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}{what}, started {started}{beat}"

    # ------------------------------------------------------------------ owning
    def try_acquire(self) -> bool:
        """Take the lock if it is free (True) and start its heartbeat; never waits."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "what": self.what}, f)
        self._start_heartbeat()
        return True

    def take_over(self, dead: dict[str, Any]) -> bool:
        """Remove the lock of `dead` (an owner judged dead by `dead_owner`), at most once overall."""
        token = f"{self.path}.takeover-{dead.get('host')}-{dead.get('pid')}-{dead.get('started')}"
        try:
            os.close(os.open(token, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False
        if self.owner() != dead:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        return True

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self._stop = self._thread = None
        if self.owner().get("pid") == os.getpid() and self.owner().get("host") == socket.gethostname():
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        for token in glob.glob(glob.escape(self.path) + ".takeover-*"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(token)

    def _start_heartbeat(self) -> None:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._stop = stop
        self._thread = threading.Thread(target=beat, name="harness-lock-heartbeat", daemon=True)
        self._thread.start()
