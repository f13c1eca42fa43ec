"""Ray Train as a launcher: harness's own train command in every worker of a `TorchTrainer`.

Ray places the workers (on one machine or a cluster), gives each torchrun's environment
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`/`MASTER_PORT`) and starts the process group;
each worker then runs the same `main` that `torchrun harness/train.py` runs, which finds the
group already started and uses it. Nothing of Ray's own checkpointing or restarts is used:
checkpoints, metrics and W&B are harness's, in `output_dir`, and a failed run is resumed with
`checkpoint.resume=auto` as under every launcher, so a run directory looks the same whoever
launched it.

Exit codes cross the Ray boundary two ways: a worker that returns raises `WorkerExit(code)`
(Ray hands it to the driver), and a worker that must leave at once (`os._exit`: a dead peer,
out of memory) writes its code to `HARNESS_EXIT_RECORD` first; a worker that was killed
leaves no code and is reported as lost (exit 5).
"""

from __future__ import annotations

import os
import runpy
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.distributed import EXIT_RECORD_ENV, record_exit
from harness.errors import EXIT_BUG, EXIT_OK, EXIT_PEER_LOST, ConfigError
from harness.log import get_logger
from harness.reliability import collective_timeout_s

log = get_logger(__name__)


class WorkerExit(RuntimeError):
    """A worker's harness command ended with a non-zero exit code (its one line is already printed)."""

    def __init__(self, code: int, rank: int):
        super().__init__(f"rank {rank} exited with code {code}")
        self.code, self.rank = code, rank

    def __reduce__(self) -> tuple:
        return (WorkerExit, (self.code, self.rank))


@dataclass(frozen=True)
class RayLaunch:
    """What `python -m harness.ray` was asked for; `train_argv` is the train command's own arguments."""

    num_workers: int
    train_argv: list[str]
    output_dir: str
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    address: str | None = None  # a running cluster (`ray start --head`); None: RAY_ADDRESS, else a local one
    workdir: str = field(default_factory=os.getcwd)

    def check(self) -> None:
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers {self.num_workers}: give at least 1 worker")
        if self.cpus_per_worker <= 0:
            raise ConfigError(f"--cpus-per-worker {self.cpus_per_worker}: give a positive number of CPUs")
        if self.gpus_per_worker < 0:
            raise ConfigError(f"--gpus-per-worker {self.gpus_per_worker}: give 0 (CPU workers) or more")


def worker_loop(config: dict) -> None:
    """The body of every Ray worker: the train command, in the driver's working directory."""
    if os.path.isdir(config["workdir"]):  # relative paths in the config mean what they meant to the driver
        os.chdir(config["workdir"])
    os.environ[EXIT_RECORD_ENV] = config["exit_record"]
    rank = int(os.environ.get("RANK", "0"))
    command = runpy.run_module("harness.train", run_name="harness_ray_worker")  # as a launcher runs the script
    try:
        code = command["main"](config["train_argv"])
    except SystemExit as exc:  # the supervisor's agreed exits (non-finite stop, checkpoint failure)
        code = exc.code if isinstance(exc.code, int) else EXIT_BUG
    record_exit(code)
    if code != EXIT_OK:
        raise WorkerExit(code, rank)


def _recorded_codes(where: str, world: int) -> dict[int, int]:
    codes = {}
    for rank in range(world):
        path = Path(where, f"rank-{rank}")
        try:
            codes[rank] = int(path.read_text())
        except (OSError, ValueError):
            continue
    return codes


def outcome(world: int, recorded: dict[int, int], raised: dict[int, BaseException]) -> tuple[int, str]:
    """The run's exit code and its one line, from each worker's recorded code and what Ray raised.

    A worker with neither a record nor a `WorkerExit` was killed (a signal, the OOM killer, a lost
    node): the run ended because a peer was lost (5). Otherwise the first failed rank's code."""
    codes = dict(recorded)
    for rank, exc in raised.items():
        if isinstance(exc, WorkerExit):
            codes.setdefault(rank, exc.code)
    lost = sorted(r for r in raised if r not in codes) or sorted(r for r in range(world) if r not in codes)
    failed = {r: c for r, c in sorted(codes.items()) if c != EXIT_OK}
    if lost and not failed:
        names = ", ".join(f"rank {r}" for r in lost)
        return EXIT_PEER_LOST, f"{names} died without an exit code (killed: a signal, the OOM killer or a lost node)"
    if not failed:
        return EXIT_OK, ""
    rank, code = next(iter(failed.items()))
    also = f"; {', '.join(f'rank {r}' for r in lost)} died without an exit code" if lost else ""
    return code, f"rank {rank} exited with code {code} (its error is printed above){also}"


def launch(req: RayLaunch) -> int:
    """Run the train command on `req.num_workers` Ray workers; the documented exit code of the run."""
    import ray  # an optional dependency (`pip install harness[ray]`), 2-3 s to import
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError

    address = req.address or os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=True, configure_logging=False)
    except ConnectionError as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address}: {exc}; start it (`ray start --head`) or leave --address out"
        ) from exc
    os.makedirs(req.output_dir, exist_ok=True)
    exit_record = tempfile.mkdtemp(prefix=".harness-ray-exit-", dir=req.output_dir)  # shared with the workers
    use_gpu = req.gpus_per_worker > 0
    resources = {"CPU": req.cpus_per_worker} | ({"GPU": req.gpus_per_worker} if use_gpu else {})
    trainer = TorchTrainer(
        worker_loop,
        train_loop_config={"train_argv": req.train_argv, "workdir": req.workdir, "exit_record": exit_record},
        scaling_config=ScalingConfig(num_workers=req.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", init_method="env", timeout_s=int(collective_timeout_s())),
        # Ray's own files (its run state, no checkpoints: harness writes those) beside the run's
        run_config=RunConfig(name="ray", storage_path=os.path.abspath(req.output_dir), failure_config=FailureConfig(max_failures=0)),
    )
    log.info(
        "Ray Train: %d workers (%s CPU%s each)", req.num_workers, req.cpus_per_worker, f", {req.gpus_per_worker} GPU" if use_gpu else ""
    )
    try:
        trainer.fit()
        code, line = EXIT_OK, ""
    except WorkerGroupError as exc:
        code, line = outcome(req.num_workers, _recorded_codes(exit_record, req.num_workers), dict(exc.worker_failures))
    except TrainingFailedError as exc:
        code, line = outcome(req.num_workers, _recorded_codes(exit_record, req.num_workers), {})
        line = line or f"Ray Train failed outside the workers: {str(exc).splitlines()[-1]}"
        code = code or EXIT_BUG
    finally:
        shutil.rmtree(exit_record, ignore_errors=True)  # made by this launch, above
        ray.shutdown()
    if code != EXIT_OK:
        raise RayRunFailed(code, line + "; resume with checkpoint.resume=auto" if code == EXIT_PEER_LOST else line)
    return EXIT_OK


class RayRunFailed(RuntimeError):
    """The run ended with a documented non-zero code; the message is the driver's one line."""

    def __init__(self, code: int, line: str):
        super().__init__(line)
        self.code = code
