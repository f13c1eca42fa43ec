"""`python -m harness.config --reference`: print the configuration reference (docs/configuration.md),
generated from the schema (`harness.config.reference`)."""

from __future__ import annotations

import argparse
import sys

from harness import imports_done  # the package first: as the program, the imports below run with the collector held
from harness.config.reference import reference_markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.config", description=__doc__)
    parser.add_argument("--reference", action="store_true", help="print docs/configuration.md as the schema says it")
    args = parser.parse_args(argv)
    if not args.reference:
        parser.print_help()
        return 2
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    imports_done()
    sys.exit(main())
