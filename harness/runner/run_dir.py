"""One run directory, one owner: `<output_dir>/.harness-run.lock` (`harness.distributed.FileLock`).

Pre-flight refuses a directory whose lock has a live owner, on every rank, before anything
starts; after the process group starts, rank 0 takes the lock (a run that died is taken
over) and every rank learns the outcome, so two runs racing for one directory cannot both
start. The lock is released when the run ends; a crashed run's lock is recognised as dead
(its process is gone, or its heartbeat stopped `HARNESS_LOCK_STALE_S` ago).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from harness.distributed import Collectives, DistInfo, FileLock
from harness.errors import ConfigError
from harness.log import get_logger

log = get_logger(__name__)
RUN_LOCK = ".harness-run.lock"


def run_lock(output_dir: str) -> FileLock:
    return FileLock(os.path.join(output_dir, RUN_LOCK), what="a harness run")


def _in_use(output_dir: str, lock: FileLock) -> str:
    return (
        f"output_dir '{output_dir}' is in use by another run ({lock.describe()}); wait for it to end or choose another "
        f"output_dir (a run that died frees it once its process is gone or its heartbeat is "
        f"{os.environ.get('HARNESS_LOCK_STALE_S', '120')} s old)"
    )


def check_not_in_use(output_dir: str) -> None:
    """Pre-flight (read only): ConfigError when a live run holds the directory.

    Skipped where the launcher started the process group before our pre-flight (Ray Train): there
    rank 0 may already hold the lock for this very run while another rank is still in pre-flight,
    and `acquire`, a collective, is the check (the driver made this one before any worker started)."""
    if dist.is_initialized():
        return
    lock = run_lock(output_dir)
    if lock.heartbeat_age_s() is not None and lock.dead_owner() is None:
        raise ConfigError(_in_use(output_dir, lock))


def acquire(output_dir: str, info: DistInfo) -> FileLock | None:
    """Rank 0 takes the lock (collective: every rank raises ConfigError if it could not)."""
    lock, refusal = None, ""
    if info.is_main:
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as exc:
            refusal = f"output_dir '{output_dir}' cannot be created ({exc.strerror}); choose another output_dir"
        if not refusal:
            lock = run_lock(output_dir)
            taken = lock.try_acquire()
            dead = None if taken else lock.dead_owner()
            if dead is not None and lock.take_over(dead):
                log.warning(f"output_dir {output_dir}: the run that held it ({lock.describe(dead)}) is gone; taking it over")
                taken = lock.try_acquire()
            if not taken:
                refusal, lock = _in_use(output_dir, lock), None
    if Collectives().any([bool(refusal)])[0]:
        raise ConfigError(refusal)  # the message is rank 0's; the others exit with the same code, silently
    return lock
