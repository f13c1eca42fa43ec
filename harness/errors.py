"""The errors a user can cause or meet, and the exit code each ends a command with.

One vocabulary for every entry point and every rank: a launcher, a SLURM script or a test
reads the code to learn what happened without parsing output. The message is always one
actionable line on stderr (rank 0 for agreed failures; the affected rank otherwise).

| code | meaning |
|---|---|
| 0 | done (or preempted: saved, the job may requeue); `harness.plan`: the config fits |
| 1 | an unexpected bug (a traceback) |
| 2 | bad input: the config, a file or the environment (nothing launched or written) |
| 3 | a non-finite loss/gradient stopped the run (`checkpoint.on_nonfinite=stop`) |
| 4 | out of memory (with a report of what was held) |
| 5 | a peer rank died or hangs |
| 6 | a checkpoint could not be written or read (`harness.checkpoint`: none found) |
| 7 | `harness.train --check`: the run computes something else than its world-1 reference (the first parameter that differs is named) |
| 10 | `harness.plan`: the config does not fit (another would: `--recommend`) |
| 11 | `harness.plan`: nothing fits, even with full offload |

The planner's verdicts have codes of their own (10, 11) so that a script never mistakes
"does not fit" for a crash (1) or "nothing fits" for a diverged run (3).
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import sys
from collections.abc import Callable
from typing import ParamSpec

EXIT_OK = 0
EXIT_BUG = 1
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_OOM = 4
EXIT_PEER_LOST = 5
EXIT_CHECKPOINT = 6
EXIT_WRONG_RESULTS = 7
EXIT_PLAN_DOES_NOT_FIT = 10
EXIT_PLAN_NOTHING_FITS = 11

P = ParamSpec("P")


class ConfigError(ValueError):
    """A run config, strategy file or input that cannot work; the message says what to change."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message says which and what to do."""


class StopRequested(BaseException):
    """A stop signal (SIGTERM, SIGUSR1, Ctrl-C) arrived where there is no step to save at: before the
    first step (loading, waiting, preparing data), or while pruning (whose partial result is not kept;
    `harness.train` saved the trained model before it). The work in progress is discarded, the command
    exits 0. A BaseException, as KeyboardInterrupt is: the stop handler raises it wherever the main
    thread is, and no `except Exception` on the way (a reader's, a library's) may turn it into an error."""


class NonFiniteError(RuntimeError):
    """The run stops on a non-finite loss/gradient (policy `stop`, or weights already corrupted)."""


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from environment knob `name` (`default` when unset); ConfigError
    naming the knob when it is not one (a timeout of 'abc' or -1 would otherwise be a traceback
    mid-run, or a wait with no bound)."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number of seconds; unset it (default {default:g}) or give e.g. {default:g}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive, finite number of seconds (default {default:g})")
    return seconds


def did_you_mean(word: str, valid: list[str], cutoff: float = 0.0) -> str:
    """ " (did you mean 'x'?)" naming the closest valid spelling, or "" when none is within `cutoff`."""
    close = difflib.get_close_matches(word, valid, n=1, cutoff=cutoff)
    return f" (did you mean '{close[0]}'?)" if close else ""


def command_errors(
    prog: str, errors: tuple[type[Exception], ...] = (ConfigError,), code: int = EXIT_BAD_INPUT
) -> Callable[[Callable[P, int]], Callable[P, int]]:
    """Decorate a command's `main`: any of `errors` becomes one line `<prog>: error: <message>` on
    stderr and the exit code `code`, the same shape from every entry point. An error with an
    empty message (a refusal agreed by all ranks, whose text rank 0 printed) prints nothing."""

    def wrap(main: Callable[P, int]) -> Callable[P, int]:
        @functools.wraps(main)
        def run(*args: P.args, **kwargs: P.kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except errors as exc:
                if str(exc):
                    print(f"{prog}: error: {exc}", file=sys.stderr)
                return code

        return run

    return wrap
