"""The JIT build lock of torch/DeepSpeed C++ extensions: a bounded wait, and a stale lock named.

DeepSpeed builds its CPU ops (CPU Adam, ...) with `torch.utils.cpp_extension.load`, which
serialises builds through a `FileBaton`: a file `<extensions dir>/<op>/lock` created with
O_EXCL, removed when the build ends, and waited on forever (a 0.1 s poll) by every other
process. A build killed midway (Ctrl-C, an OOM kill, a preempted job) leaves the file behind,
and every later DeepSpeed start then waits silently for ever. The baton records no owner, so
before DeepSpeed is touched each lock is judged here:

- provably stale (no process on this host builds in that directory, and neither the lock
  nor any file beside it changed for `HARNESS_BUILD_LOCK_STALE_S`, 300 s): removed, with a
  warning naming it;
- otherwise (a build is running, or ran recently, perhaps on another node sharing the
  directory): waited for, with a line naming the file, at most `HARNESS_BUILD_LOCK_WAIT_S`
  (900 s); then one line (exit 2) telling the user which file to remove.

A build can also be killed while this process already waits inside torch's `FileBaton.wait`
(another rank or job building the same op). `guarded_builds` covers that wait: a watchdog thread
judges the locks the same way while DeepSpeed starts, removes one that becomes provably stale
(the baton's poll then sees it gone and this process builds), says which lock it waits for after
a minute, and ends a wait on a lock that no process on this host builds after
`HARNESS_BUILD_LOCK_WAIT_S` with the same one line (it raises an exception in the main thread's poll).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator

import torch

from harness.errors import ConfigError, env_seconds
from harness.log import get_logger

log = get_logger(__name__)


def environment_extensions_dir() -> str:
    """This Python environment's own build folder: `<cache>/torch_extensions/<py>_<cpu|cuXY>-<env>-<hash>`.

    torch's default (`<cache>/torch_extensions/py311_cpu`) is shared by every environment of that
    Python, but a build is keyed by the environment's include paths: two virtual environments (two
    checkouts, a checkout and a benchmark's) rebuild the same op over each other, and each run waits
    minutes on the other's build lock. One folder per environment (its prefix and torch version in
    the hash) builds each op once per environment."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    accel = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    key = hashlib.sha256(f"{os.path.realpath(sys.prefix)}|{torch.__version__}".encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(os.path.realpath(sys.prefix)))
    return os.path.join(cache, "torch_extensions", f"py{sys.version_info.major}{sys.version_info.minor}_{accel}-{name}-{key}")


def use_environment_extensions_dir() -> None:
    """Unless the user set `TORCH_EXTENSIONS_DIR`, point it at this environment's own folder
    (`environment_extensions_dir`), said once in the log."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    os.environ["TORCH_EXTENSIONS_DIR"] = folder = environment_extensions_dir()
    log.info(f"DeepSpeed's JIT-built ops go to this environment's own folder {folder} (TORCH_EXTENSIONS_DIR chooses another)")


def extension_roots() -> list[str]:
    """Where torch builds extensions: `TORCH_EXTENSIONS_DIR`, else the user cache's `torch_extensions`."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return [explicit]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(cache, "torch_extensions")]


def build_locks(roots: list[str] | None = None) -> list[str]:
    """Every `lock` file of an extension build directory (`<root>/<op>/lock`, `<root>/<py_acc>/<op>/lock`)."""
    found: list[str] = []
    for root in roots if roots is not None else extension_roots():
        found += glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))
    return sorted(found)


def builders_here(build_dir: str) -> list[int]:
    """Pids on this host whose working directory is `build_dir` (torch runs ninja there)."""
    target = os.path.realpath(build_dir)
    pids = []
    for entry in glob.glob("/proc/[0-9]*/cwd"):
        try:
            cwd = os.path.realpath(os.readlink(entry))
        except OSError:  # gone, or not ours to read
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            pids.append(int(entry.split("/")[2]))
    return pids


def stale_reason(lock: str, stale_s: float) -> str:
    """Why `lock` is provably stale ("" when it may belong to a live build)."""
    build_dir = os.path.dirname(lock)
    if builders_here(build_dir):
        return ""
    try:
        newest = max(os.stat(p).st_mtime for p in [lock, *glob.glob(os.path.join(build_dir, "*"))] if os.path.exists(p))
    except (OSError, ValueError):
        return ""
    idle = time.time() - newest
    if idle < stale_s:
        return ""
    return f"no process on this host builds there and nothing in {build_dir} changed for {idle:.0f} s (a killed build left it)"


def remove_if_stale(lock: str, stale_s: float, when: str) -> bool:
    """Remove `lock` when it is provably stale, saying why; whether it is gone."""
    reason = stale_reason(lock, stale_s)
    if not reason:
        return False
    try:
        os.remove(lock)
        log.warning(f"removed the stale extension build lock {lock}{when}: {reason}")
    except FileNotFoundError:
        pass
    return True


def clear_build_locks(roots: list[str] | None = None, poll_s: float = 1.0) -> None:
    """Before DeepSpeed may JIT-build an op: remove provably stale build locks, wait (bounded, said)
    for live ones; ConfigError naming the file when one outlives `HARNESS_BUILD_LOCK_WAIT_S`."""
    stale_s = env_seconds("HARNESS_BUILD_LOCK_STALE_S", 300.0)
    wait_s = env_seconds("HARNESS_BUILD_LOCK_WAIT_S", 900.0)
    for lock in build_locks(roots):
        start, said = time.monotonic(), False
        while os.path.exists(lock):
            if remove_if_stale(lock, stale_s, ""):
                break
            waited = time.monotonic() - start
            if waited >= wait_s:
                raise ConfigError(_held_too_long(lock, waited))
            if not said:
                log.warning(
                    f"waiting for the extension build lock {lock} (a build of '{os.path.basename(os.path.dirname(lock))}' "
                    f"is running or stopped recently; at most {wait_s:.0f} s, HARNESS_BUILD_LOCK_WAIT_S)"
                )
                said = True
            time.sleep(min(poll_s, max(0.0, wait_s - waited)))


def _held_too_long(lock: str, waited: float) -> str:
    return (
        f"the extension build lock {lock} is still held after {waited:.0f} s (HARNESS_BUILD_LOCK_WAIT_S); "
        f"if no build of '{os.path.basename(os.path.dirname(lock))}' is running on any node, remove {lock}"
    )


class _LockWaitEnded(BaseException):
    """Raised in the main thread by the watchdog: a BaseException, so no `except Exception` on the way
    (torch's, DeepSpeed's) swallows it."""


class _Watchdog:
    """The watchdog of `guarded_builds`: every `poll_s`, each lock present is judged as before start.

    It ends the main thread's wait with an exception set on that thread (`PyThreadState_SetAsyncExc`),
    not with a signal: a signal would run whatever handler the process installed (harness's own turns
    SIGINT into a stop request), and the wait would go on."""

    def __init__(self, roots: list[str] | None, poll_s: float):
        self.roots, self.poll_s = roots, poll_s
        self.stale_s = env_seconds("HARNESS_BUILD_LOCK_STALE_S", 300.0)
        self.wait_s = env_seconds("HARNESS_BUILD_LOCK_WAIT_S", 900.0)
        self.failure = ""
        self._main = threading.main_thread().ident
        self._gate = threading.Lock()  # no exception is set on the main thread once it has left the guarded block
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harness-build-lock-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        first_seen: dict[str, float] = {}
        said: set[str] = set()
        while not self._stopped.wait(self.poll_s):
            locks = build_locks(self.roots)
            first_seen = {lock: first_seen.get(lock, time.monotonic()) for lock in locks}
            for lock in locks:
                if remove_if_stale(lock, self.stale_s, " while DeepSpeed waited on it"):
                    continue
                held = time.monotonic() - first_seen[lock]
                if held >= self.wait_s and not builders_here(os.path.dirname(lock)):
                    self._end_main_wait(_held_too_long(lock, held))
                    return
                if held >= min(60.0, self.wait_s / 2) and lock not in said:
                    log.warning(
                        f"an extension build holds {lock} ({held:.0f} s so far; removed once stale, "
                        f"at most {self.wait_s:.0f} s with no builder on this host, HARNESS_BUILD_LOCK_WAIT_S)"
                    )
                    said.add(lock)

    def _end_main_wait(self, failure: str) -> None:
        with self._gate:
            if self._stopped.is_set():  # the guarded block has just ended
                return
            self.failure = failure
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._main), ctypes.py_object(_LockWaitEnded))

    def stop(self) -> None:
        with self._gate:
            self._stopped.set()
            if self.failure:  # set but perhaps not yet raised: the block ended first, nothing is left to end
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._main), None)
        self._thread.join(timeout=self.poll_s + 1.0)


@contextlib.contextmanager
def guarded_builds(roots: list[str] | None = None, poll_s: float = 5.0) -> Iterator[None]:
    """Around code that may JIT-build an extension (DeepSpeed's start): stale locks cleared first
    (`clear_build_locks`), then a watchdog thread bounds torch's own wait on a lock (module doc).
    ConfigError (one line, naming the file) when the watchdog ends that wait. With no `roots` given,
    the builds go to this environment's own folder unless `TORCH_EXTENSIONS_DIR` says otherwise."""
    if roots is None:
        use_environment_extensions_dir()
    clear_build_locks(roots)
    watchdog = _Watchdog(roots, poll_s)
    try:
        try:
            yield
        finally:
            watchdog.stop()
    except _LockWaitEnded:
        raise ConfigError(watchdog.failure) from None
