"""Library messages go through `logging`, under the `harness` logger, in one format.

    log = get_logger(__name__)
    log.info("saved checkpoint %s", path)              # rank 0 only: "[harness] saved checkpoint ..."
    log.info("...", extra=ALL_RANKS)                   # every rank
    log.warning("W&B: ...")                            # stderr, every rank

INFO goes to stdout, WARNING and above to stderr (where launchers and SLURM keep errors).
Informational records are shown on rank 0 alone unless they carry `ALL_RANKS`: eight ranks
saying "saved checkpoint" is noise. `HARNESS_LOG_LEVEL` (DEBUG, INFO, WARNING) sets the
level. The streams are looked up when a record is written, so a redirected `sys.stdout`
(a test's capture, a progress bar's) receives it.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT_LOGGER = "harness"
ALL_RANKS = {"all_ranks": True}
_state = {"rank": None}
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _StreamHandler(logging.Handler):
    """Writes to the current sys.stdout (below WARNING) or sys.stderr, flushing each record."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = _state["rank"]
        if rank is None:  # a garbage RANK is refused by pre-flight; its message must still get out
            value = os.environ.get("RANK", "0").strip()
            rank = int(value) if value.isdigit() else 0
        return rank == 0 or record.levelno >= logging.WARNING or getattr(record, "all_ranks", False)


def _configure() -> logging.Logger:
    root = logging.getLogger(ROOT_LOGGER)
    if not any(isinstance(h, _StreamHandler) for h in root.handlers):
        handler = _StreamHandler()
        handler.setFormatter(logging.Formatter("[harness] %(message)s"))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        level = os.environ.get("HARNESS_LOG_LEVEL", "INFO").strip().upper()
        root.setLevel(level if level in LEVELS else "INFO")  # pre-flight names a wrong one
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of a harness module (`name` is its `__name__`), configured on first use."""
    _configure()
    return logging.getLogger(name)


def set_rank(rank: int) -> None:
    """Called once the process group knows this process's rank (before that: the launcher's RANK)."""
    _state["rank"] = rank
