"""The process group, independent of the launcher: who we are (rank, world, device), collectives
on plain Python values, a clean teardown and exit; and `FileLock`, coordination through a
(possibly shared) file system that survives a crash."""

from harness.distributed.filelock import FileLock
from harness.distributed.process_group import (
    DistInfo,
    all_gather_object,
    all_reduce_mean,
    all_reduce_sum,
    exit_process,
    free_port,
    init_distributed,
    launch_env,
    pick_device,
    teardown,
)
from harness.distributed.tensors import local_tensor

__all__ = [
    "DistInfo",
    "FileLock",
    "all_gather_object",
    "all_reduce_mean",
    "all_reduce_sum",
    "exit_process",
    "free_port",
    "init_distributed",
    "launch_env",
    "local_tensor",
    "pick_device",
    "teardown",
]
