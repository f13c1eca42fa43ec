"""The SLURM batch script for a node count, rendered from the one template (`slurm.sbatch`).

The template is the multi-node script harness ships (`launch/slurm_multinode.sbatch` is this
module's output for its defaults, byte for byte): one `srun` task per node starting `torchrun`
with a c10d rendezvous on the first node, `--requeue`, and a signal `signal_lead` seconds
before the time limit that makes every worker save a checkpoint and exit 0, after which the job
requeues itself and resumes with `checkpoint.resume=auto`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from importlib import resources

from harness.errors import ConfigError

TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")  # SLURM's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S


@dataclass(frozen=True)
class SlurmJob:
    nodes: int = 2
    gpus_per_node: int = 8
    time: str = "24:00:00"
    cpus_per_task: int = 32
    signal_lead: int = 90  # seconds before the time limit that SIGUSR1 arrives: room for one step and a save
    job_name: str = "harness"
    partition: str | None = None
    account: str | None = None
    name: str = "slurm_multinode.sbatch"  # the file the script is written to (its usage line names it)
    path: str = "launch/slurm_multinode.sbatch"
    train_args: list[str] = field(default_factory=list)  # config and overrides baked in as the default arguments

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def check(self) -> None:
        for flag, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node), ("--cpus-per-task", self.cpus_per_task)):
            if value < 1:
                raise ConfigError(f"{flag} {value}: give at least 1")
        if self.signal_lead < 10:
            raise ConfigError(f"--signal-lead {self.signal_lead}: give at least 10 s, time for a step and a checkpoint save")
        if not TIME_RE.match(self.time):
            raise ConfigError(f"--time {self.time!r} is not a SLURM time limit: give e.g. 24:00:00, 90, or 2-00:00:00")
        if not re.fullmatch(r"[\w.-]+", self.job_name):
            raise ConfigError(f"--job-name {self.job_name!r}: use letters, digits, '_', '.' or '-'")


def sbatch_header(job: SlurmJob) -> str:
    lines = [
        f"--job-name={job.job_name}",
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--account={job.account}"] if job.account else []),
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={job.gpus_per_node}",
        f"--cpus-per-task={job.cpus_per_task}",
        f"--time={job.time}",
        f"--signal=B:USR1@{job.signal_lead}",
        "--requeue",
        "--open-mode=append",
        "--output=slurm-%x-%j.out",
    ]
    return "".join(f"#SBATCH {line}\n" for line in lines)


def render(job: SlurmJob) -> str:
    """The batch script; `sbatch <it>` runs the baked-in config, `sbatch <it> other.yaml k=v` another."""
    job.check()
    defaults = ""
    if job.train_args:
        defaults = f"[ $# -gt 0 ] || set -- {shlex.join(job.train_args)}  # the config it was generated for\n"
    text = resources.files("harness.scaleout").joinpath("slurm.sbatch").read_text()
    for key, value in (
        ("@SBATCH@", sbatch_header(job)),
        ("@DEFAULTS@", defaults),
        ("@NAME@", job.name),
        ("@PATH@", job.path),
        ("@GPUS_PER_NODE@", str(job.gpus_per_node)),
        ("@SIGNAL_LEAD@", str(job.signal_lead)),
    ):
        text = text.replace(key, value)
    return text
