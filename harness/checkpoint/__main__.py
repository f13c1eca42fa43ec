"""`python -m harness.checkpoint <run_dir>`: list a run's checkpoints and which one `latest` names."""

from __future__ import annotations

import argparse
import os
import sys

from harness import imports_done  # the package first: as the program, the imports below run with the collector held
from harness.checkpoint.layout import checkpoint_root, complete_checkpoints, latest_checkpoint, read_meta
from harness.errors import EXIT_CHECKPOINT, EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harness.checkpoint", description=__doc__)
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    root = checkpoint_root(args.run_dir) if os.path.isdir(checkpoint_root(args.run_dir)) else args.run_dir
    latest = latest_checkpoint(root)
    for step, path in complete_checkpoints(root):
        meta = read_meta(path)
        mark = "  <- latest" if latest and os.path.abspath(path) == os.path.abspath(latest) else ""
        print(f"{path}  step {step}  {meta.strategy} x{meta.world_size}  global batch {meta.global_batch}{mark}")
    return EXIT_OK if latest else EXIT_CHECKPOINT  # none found: the checkpoint code, not 1 (a bug)


if __name__ == "__main__":
    imports_done()
    sys.exit(main())
