"""harness: train, plan and prune causal LMs under any strategy (see the README).

Importing the package sets how a harness process starts: its imports run with the garbage
collector held.

Importing torch, transformers and harness makes ~340,000 objects that live as long as the process
(modules, classes, functions, dispatch tables), and CPython's collector walks every one of them at
each full collection: five full collections during `harness.train`'s own imports, ~0.8 s of GC in a
rank's ~5 s of CPU before its first step (notes/performance.md, "Start-up"). The package is
imported before any of its modules; when a harness entry point is the process's program (not when a test, a
notebook or a Ray worker imports it), automatic collection waits until the entry point calls
`imports_done()`. That freezes everything imported so far (`gc.freeze`: moved to the permanent
generation, never scanned again; import-time objects are not garbage) and turns collection back on,
so the model's build and every step collect as usual, over only what they made.
"""

from __future__ import annotations

import gc
import os
import sys

_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))


def _program_is_a_harness_entry_point() -> bool:
    """`python -m harness.<x>` (while runpy imports this package the main module is not set yet:
    the command line names it; later the main module's spec does) or a launcher running
    `harness/<x>.py` as a file (torchrun, accelerate, deepspeed: no spec, the file's path)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name.startswith("harness.")
    if sys.argv[:1] == ["-m"]:
        args = list(getattr(sys, "orig_argv", []))
        return "-m" in args and args[args.index("-m") + 1 :][:1] != [] and args[args.index("-m") + 1].startswith("harness.")
    path = getattr(main, "__file__", None)
    return path is not None and os.path.dirname(os.path.abspath(path)) == _HARNESS_DIR


_held = _program_is_a_harness_entry_point() and gc.isenabled()
if _held:
    gc.disable()


def imports_done() -> None:
    """Called by an entry point once its imports have run, before any work: freeze what they made
    and collect as usual from here on. Does nothing where this module held nothing."""
    global _held
    if _held:
        _held = False
        gc.freeze()
        gc.enable()
