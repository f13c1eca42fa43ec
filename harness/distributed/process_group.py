"""Process-group lifecycle, independent of the launcher.

accelerate, deepspeed, torchrun and SLURM's srun all describe a process by environment
variables; we read them ourselves and start one torch process group (NCCL on GPUs, gloo on
CPU) that every engine then shares. That is what makes the four launch commands run the
same training, and what lets sharding work on CPU where accelerate would drop it.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.errors import ConfigError
from harness.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when running as a single process without a group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def env_int(env: dict[str, str], key: str, minimum: int = 0, maximum: int | None = None) -> int:
    """An integer launcher variable; ConfigError (one line, exit 2) naming it when it is not one."""
    value = env[key]
    try:
        number = int(value.strip())
    except ValueError:
        raise ConfigError(f"launcher variable {key}={value!r} is not an integer; check the launch command or job script") from None
    if number < minimum or (maximum is not None and number > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(f"launcher variable {key}={number} must be {bound}; check the launch command or job script")
    return number


def _local_rank_from_argv(argv: list[str]) -> int | None:
    """deepspeed's launcher passes `--local_rank=N` to the script."""
    for i, arg in enumerate(argv):
        value = (
            arg.split("=", 1)[1]
            if arg.startswith("--local_rank=")
            else argv[i + 1]
            if arg == "--local_rank" and i + 1 < len(argv)
            else None
        )
        if value is not None:
            return env_int({"--local_rank": value}, "--local_rank")
    return None


def launch_env(argv: list[str] | None = None, env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from whichever launcher started us; ConfigError (one line)
    for values no launcher writes: not integers, a rank outside the world, a port out of range
    (each would otherwise wait the whole collective timeout for ranks that never come)."""
    env = dict(os.environ) if env is None else env
    argv = sys.argv if argv is None else argv
    if env.get("MASTER_PORT") is not None:
        env_int(env, "MASTER_PORT", 1, 65535)
    if "MASTER_ADDR" in env and not env["MASTER_ADDR"].strip():
        raise ConfigError("launcher variable MASTER_ADDR is empty; check the launch command or job script")
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = env_int(env, "RANK"), env_int(env, "WORLD_SIZE", 1)
        local = env.get("LOCAL_RANK")
        local_rank = env_int(env, "LOCAL_RANK") if local is not None else (_local_rank_from_argv(argv) or 0)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "MASTER_ADDR" in env:
        rank, world = env_int(env, "SLURM_PROCID"), env_int(env, "SLURM_NTASKS", 1)
        local_rank = env_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    else:
        return 0, 1, 0
    if rank >= world:
        raise ConfigError(f"launcher variables say rank {rank} of a world of {world} (ranks are 0..{world - 1}); check the launch command")
    return rank, world, local_rank


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device=cuda was requested but no GPU is visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device: str = "auto", timeout_s: float = 600.0, force_group: bool = False) -> DistInfo:
    """Start the process group (if the launcher made more than one process).

    `force_group` starts a group of one, for engines (DeepSpeed) that insist on one.
    """
    rank, world, local_rank = launch_env()
    dev = pick_device(device, local_rank)
    if world == 1 and not force_group:
        return DistInfo(rank, world, local_rank, dev, None)
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        if world > 1:  # a wait for every rank to arrive: said, so a user who stops it knows what it waited for
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            log.info(f"joining a process group of {world} ranks ({backend}) at {where}")
        try:
            dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        except dist.DistNetworkError as exc:
            if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc).lower():
                raise
            port = os.environ.get("MASTER_PORT")
            raise ConfigError(
                f"MASTER_PORT={port} is already in use by another process on {os.environ.get('MASTER_ADDR', 'this host')}, "
                f"so rank {rank} cannot host the rendezvous there; pick a free port (e.g. MASTER_PORT={free_port()}, or the "
                "launcher's --master_port/--main_process_port) or unset MASTER_PORT"
            ) from None
    return DistInfo(rank, world, local_rank, dev, backend)


def free_port() -> int:
    """A free TCP port on loopback (released before use: a launcher may race for it; callers retry)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def teardown(wait_for_peers: bool = True) -> None:
    """Destroy the process group so no engine aborts at interpreter exit (DeepSpeed ZeRO-3 does);
    `wait_for_peers=False` when this rank stops on its own (a stop request before the first step),
    where a barrier would wait for ranks that may be anywhere."""
    if dist.is_available() and dist.is_initialized():
        try:
            if wait_for_peers:
                dist.barrier()
        finally:
            dist.destroy_process_group()


EXIT_RECORD_ENV = "HARNESS_EXIT_RECORD"


def record_exit(code: int) -> None:
    """Write this rank's exit code to `$HARNESS_EXIT_RECORD/rank-<RANK>` when a launcher asked for it.

    A launcher that runs ranks as threads of its own worker processes (Ray Train) cannot read
    a process's exit status, and a hard exit (`os._exit`: a dead peer, out of memory) ends its
    worker before any return value; the record carries the documented code to its driver."""
    where = os.environ.get(EXIT_RECORD_ENV)
    if not where:
        return
    try:
        path = os.path.join(where, f"rank-{os.environ.get('RANK', '0')}")
        with open(path + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher then reports the rank as died without a code: still an exit, never a hang


def exit_process(code: int) -> None:
    """Leave without running C++ static destructors, after the process group is torn down.

    Seen on CPU: a rank that finished cleanly still aborted at interpreter exit ("terminate
    called without an active exception", SIGABRT) from a native thread (gloo / DeepSpeed /
    the rendezvous store client) destroyed while joinable. Everything the run writes is
    already closed and flushed by now, so skipping those destructors loses nothing. Also the
    one way out of a rank that cannot wait for its peers (a dead peer, out of memory).
    """
    record_exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
