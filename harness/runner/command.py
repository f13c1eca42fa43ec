"""The shape of every run command: parse, validate before any process group starts, then run
the body under the supervisor and tear the group down."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from harness.config import RunConfig
from harness.distributed import configure_cuda_allocator, init_distributed, teardown
from harness.engine import EnginePlan
from harness.errors import EXIT_CHECKPOINT, EXIT_OK, CheckpointError, StopRequested, command_errors
from harness.log import ALL_RANKS, get_logger, set_rank
from harness.reliability import Supervisor, collective_timeout_s, entering, stop_requests
from harness.runner import run_dir

log = get_logger(__name__)


def parse_command_line(
    prog: str, doc: str | None, argv: list[str] | None, flags: tuple[tuple[str, str], ...] = ()
) -> tuple[argparse.Namespace, list[str]]:
    """`--config <file>` and `key=value` overrides; `--local_rank` (from the deepspeed launcher) is accepted;
    `flags`: the command's own on/off switches, (flag, help)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="run config (YAML or JSON); omitted: the embedded default")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    for flag, text in flags:
        parser.add_argument(flag, action="store_true", help=text)
    return parser.parse_known_args(argv)


def run_command(prog: str, load: Callable[[], tuple[RunConfig, EnginePlan]], body: Callable[..., Any]) -> int:
    """Shared by `harness.train` and `harness.prune`: every check that can fail runs in `load`,
    before any process group starts (one line, exit 2), pre-flight's resolution included; then `body(cfg, plan, info)` runs,
    `cfg` the resolved run config (`plan.config`),
    under the supervisor (OOM, dead ranks, NaN stop, SIGTERM -> a message and an exit code).
    A ConfigError found after the group started is still one line and the same code on every
    rank (an agreed refusal carries its message on rank 0 only: the others print nothing)."""

    @command_errors(prog, (CheckpointError,), EXIT_CHECKPOINT)  # a checkpoint to resume that is corrupt or incomplete
    @command_errors(prog)
    def run() -> int:
        allocator = configure_cuda_allocator()  # before anything can initialise CUDA
        info, lock, stopped, failed, result = None, None, False, False, None
        with stop_requests("checking the run config"):  # a stop before the first step ends the run at once
            try:
                _, plan = load()
                cfg = plan.config  # the run config pre-flight resolved: the body builds every component from it
                entering("joining the process group")
                info = init_distributed(cfg.device, collective_timeout_s(), force_group=plan.strategy.needs_process_group)
                set_rank(info.rank)
                log.log(logging.INFO if info.device.type == "cuda" else logging.DEBUG, allocator)
                entering("taking the output directory")
                lock = run_dir.acquire(cfg.output_dir, info)
                with Supervisor(cfg, info):
                    result = body(cfg, plan, info)
            except StopRequested as stop:  # nothing to save (before the first step, or pruning): exit 0 so the job may requeue
                stopped = True
                log.info(f"{stop}; exiting", extra=ALL_RANKS)
            except BaseException:
                # This rank fails on its own, its peers may be inside a collective that waits for it (a
                # step's all-reduce): a barrier would wait with them until the collective timeout. Leaving
                # at once lets the launcher end them and their collectives fail on the closed connection.
                # An agreed refusal has every rank here, past the collective that agreed: nothing to wait for.
                failed = True
                raise
            finally:
                if lock is not None:
                    lock.release()
                teardown(wait_for_peers=not (stopped or failed))
        return result if isinstance(result, int) else EXIT_OK  # a body may end with a code of its own (the check)

    return run()
