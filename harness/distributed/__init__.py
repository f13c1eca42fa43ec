"""The process group, independent of the launcher: who we are (rank, world, device), the one
object every collective goes through (`Collectives`), a clean teardown and exit; the CUDA
allocator's setting (made before CUDA starts); and `FileLock`, coordination through a
(possibly shared) file system that survives a crash; `unwrap` (the module inside DDP, DeepSpeed,
compile and checkpoint wrappers)."""

from harness.distributed.allocator import configure_cuda_allocator
from harness.distributed.collectives import Collectives
from harness.distributed.filelock import FileLock
from harness.distributed.process_group import (
    EXIT_RECORD_ENV,
    DistInfo,
    exit_process,
    free_port,
    init_distributed,
    launch_env,
    pick_device,
    record_exit,
    teardown,
)
from harness.distributed.tensors import gather_rows, local_tensor
from harness.distributed.traffic import CollectiveBytes
from harness.distributed.wrappers import WRAPPER_ATTRS, is_deepspeed_engine, unwrap, wrapper_chain

__all__ = [
    "CollectiveBytes",
    "WRAPPER_ATTRS",
    "is_deepspeed_engine",
    "unwrap",
    "wrapper_chain",
    "Collectives",
    "EXIT_RECORD_ENV",
    "DistInfo",
    "FileLock",
    "exit_process",
    "free_port",
    "gather_rows",
    "init_distributed",
    "launch_env",
    "local_tensor",
    "pick_device",
    "record_exit",
    "configure_cuda_allocator",
    "teardown",
]
