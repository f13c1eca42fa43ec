"""Fault injection for tests and drills: which fault `HARNESS_FAULT` (comma-separated) asks for, where.

`nan_loss@STEP[:RANK]` (the LM head's output becomes NaN in that step's forward),
`oom@STEP[:RANK]` (a real `torch.OutOfMemoryError` raised in that step's forward),
`signal@STEP[:RANK]` (the process sends itself SIGUSR1 in that step's forward),
`kill@STEP[:RANK]` (the process sends itself SIGKILL in that step's forward: a lost worker),
`error@STEP[:RANK]` (a RuntimeError raised in that step's forward: a bug on that rank alone),
`save_pause=SECONDS[@STEP]` (a checkpoint is fully written but not committed for that long, or
until the file named by `HARNESS_FAULT_RELEASE` exists: a test ends the window when done with it),
`save_error@STEP[:RANK]` (writing that step's checkpoint fails as a full disk would: ENOSPC),
`load_pause=SECONDS` (the model's load takes that much longer, as from a slow file system: a window
in which to stop a run before its first step).

The spec is read here, at the bottom of the layers, because three layers inject: the engine's build
(`load_pause`), the checkpoint (`save_pause`, `save_error`) and the step guard's forward hook
(`harness.reliability.faults`).
"""

from __future__ import annotations

import os
import time


def _faults() -> list[tuple[str, str, int | None, int | None]]:
    """(name, value, step, rank) of each `name@STEP[:RANK]` or `name=VALUE[@STEP]` in HARNESS_FAULT;
    ValueError naming the item that is neither (pre-flight's `check_faults` turns it into one line)."""
    out = []
    for item in filter(None, (s.strip() for s in os.environ.get("HARNESS_FAULT", "").split(","))):
        name, eq, rest = item.partition("=")
        try:
            if eq:  # name=VALUE[@STEP]
                value, _, step = rest.partition("@")
                float(value)
                out.append((name, value, int(step) if step else None, None))
            else:  # name@STEP[:RANK]
                name, _, where = item.partition("@")
                step, _, rank = where.partition(":")
                out.append((name, "", int(step), int(rank) if rank else None))
        except ValueError:
            raise ValueError(f"HARNESS_FAULT item {item!r} is not name@STEP[:RANK] or name=SECONDS[@STEP]; unset HARNESS_FAULT") from None
    return out


def check_faults() -> None:
    """Pre-flight: HARNESS_FAULT parses (a typo in a drill is a ValueError before launch, not mid-run)."""
    _faults()


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
