"""Write the SLURM batch script for a run, after checking the run for that world size.

    python -m harness.slurm --nodes 4 --gpus-per-node 8 --time 48:00:00 run.yaml [key=value ...] --out job.sbatch
    python -m harness.slurm --nodes 4 --gpus-per-node 8 --gpu-mem 80GiB run.yaml --dry-run   # print it, queue nothing

The script is the one `launch/slurm_multinode.sbatch` shows (srun + torchrun with a c10d
rendezvous, `--requeue`, a checkpoint and a requeue on the signal before the time limit), with
the config and overrides baked in as its default arguments. Before anything is written the
config is checked for `nodes x gpus-per-node` ranks (a mistake is one line, exit 2) and, with
`--gpu-mem`, the planner is asked whether a step fits (its verdict and exit code, 10 or 11, stop
the script from being written). An existing `--out` is never overwritten.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from harness import imports_done  # the package first: as the program, the imports below run with the collector held
from harness.config import check_run, load_config, load_strategy
from harness.errors import EXIT_BAD_INPUT, EXIT_OK, ConfigError, command_errors
from harness.scaleout import SlurmJob, render_sbatch


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="harness.slurm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the run config (YAML or JSON) the job trains")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--time", default="24:00:00", help="SLURM time limit (default 24:00:00)")
    parser.add_argument("--cpus-per-task", type=int, default=32, help="CPUs of each node's task (default 32)")
    parser.add_argument("--signal-lead", type=int, default=90, help="seconds before the limit that the job saves and requeues (default 90)")
    parser.add_argument("--job-name", default="harness")
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--gpu-mem", help="memory of one GPU (e.g. 80GiB): ask the planner whether the run fits first")
    parser.add_argument("--out", help="where to write the script (default: <job-name>.sbatch); never overwritten")
    parser.add_argument("--dry-run", action="store_true", help="print the script and the checks; write and queue nothing")
    return parser.parse_known_args(argv)


def planner_verdict(args: argparse.Namespace, overrides: list[str], world: int) -> int:
    """The planner's exit code for this world size (its report goes to stderr)."""
    cmd = [sys.executable, "-m", "harness.plan", "--config", args.config, "--gpus", str(world)]
    cmd += ["--gpus-per-node", str(args.gpus_per_node), "--gpu-mem", args.gpu_mem, *overrides]
    return subprocess.run(cmd, stdout=sys.stderr, check=False).returncode


@command_errors("harness.slurm")
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    out = args.out or f"{args.job_name}.sbatch"
    job = SlurmJob(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        cpus_per_task=args.cpus_per_task,
        signal_lead=args.signal_lead,
        job_name=args.job_name,
        partition=args.partition,
        account=args.account,
        name=os.path.basename(out),
        path=out,
        train_args=[os.path.abspath(args.config), *overrides],
    )
    script = render_sbatch(job)
    if not args.dry_run and os.path.exists(out):
        raise ConfigError(f"--out {out} exists: harness never overwrites it; remove it or name another file")
    cfg = load_config(args.config, overrides)
    check_run(cfg, load_strategy(cfg.strategy), job.world_size, has_accelerator=True)  # every config rule, for the target world
    print(f"harness.slurm: the config checks out for {job.nodes} x {job.gpus_per_node} = {job.world_size} ranks", file=sys.stderr)
    if args.gpu_mem:
        code = planner_verdict(args, overrides, job.world_size)
        if code == EXIT_BAD_INPUT:
            return code  # the planner printed its one line
        if code != EXIT_OK:
            print(f"harness.slurm: error: the planner says the run does not fit (exit {code}); nothing written", file=sys.stderr)
            return code
    else:
        print("harness.slurm: memory not checked: give --gpu-mem to ask the planner first", file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(script)
        return EXIT_OK
    with open(out, "x") as f:  # exclusive: a file that appeared since the check is not overwritten either
        f.write(script)
    os.chmod(out, 0o755)
    print(f"wrote {out}; submit it with: sbatch {out}")
    return EXIT_OK


if __name__ == "__main__":
    imports_done()
    sys.exit(main())
