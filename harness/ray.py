"""Train on a Ray cluster: the train command in every worker of a Ray Train `TorchTrainer`.

    python -m harness.ray --config run.yaml --num-workers 2 [--cpus-per-worker 1] [key=value ...]
    python -m harness.ray --config run.yaml --num-workers 16 --gpus-per-worker 1 --address auto strategy=fsdp

Needs `pip install 'harness[ray]'`. Without `--address` (or `RAY_ADDRESS`) a local Ray cluster is
started on this machine. The config is checked here, for the world size asked, before any
worker starts (a mistake is one line, exit 2); the run then has harness's own run directory,
checkpoints, metrics and W&B, and its exit codes (docs/exit-codes.md). Ray's own
restarts are off: a run that fails ends with one line, and `checkpoint.resume=auto` continues it.
"""

from __future__ import annotations

import argparse
import sys

from harness import imports_done  # the package first: as the program, the imports below run with the collector held
from harness.config import load_config, load_strategy
from harness.errors import ConfigError, command_errors
from harness.runner import preflight
from harness.scaleout import RayLaunch, RayRunFailed, launch_ray


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="harness.ray", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="run config (YAML or JSON); omitted: the embedded default")
    parser.add_argument("--num-workers", type=int, required=True, help="Ray Train workers: the world size")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs Ray reserves for each worker (default 1)")
    parser.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs for each worker (default 0: CPU workers, gloo)")
    parser.add_argument(
        "--address", default=None, help="a running Ray cluster (`auto`, `ray://host:10001`); default: RAY_ADDRESS, else a local one"
    )
    return parser.parse_known_args(argv)


@command_errors("harness.ray")
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    req = RayLaunch(
        num_workers=args.num_workers,
        train_argv=(["--config", args.config] if args.config else []) + overrides,
        output_dir="",
        cpus_per_worker=args.cpus_per_worker,
        gpus_per_worker=args.gpus_per_worker,
        address=args.address,
    )
    req.check()
    cfg = load_config(args.config, overrides)
    preflight(cfg, load_strategy(cfg.strategy), world=req.num_workers)  # every mistake, before any worker starts
    try:
        return launch_ray(RayLaunch(**{**req.__dict__, "output_dir": cfg.output_dir}))
    except RayRunFailed as exc:
        print(f"harness.ray: error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except ImportError as exc:
        raise ConfigError(f"Ray Train is not installed ({exc.name}): pip install 'harness[ray]'") from exc


if __name__ == "__main__":
    imports_done()
    sys.exit(main())
