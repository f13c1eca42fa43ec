"""Launching past one machine on the engines users already run: Ray Train (the train command in
each `TorchTrainer` worker) and SLURM (the batch script for a node count, checked first)."""

from harness.scaleout.ray_train import RayLaunch, RayRunFailed, WorkerExit, outcome
from harness.scaleout.ray_train import launch as launch_ray
from harness.scaleout.slurm import SlurmJob
from harness.scaleout.slurm import render as render_sbatch

__all__ = ["RayLaunch", "RayRunFailed", "SlurmJob", "WorkerExit", "launch_ray", "outcome", "render_sbatch"]
