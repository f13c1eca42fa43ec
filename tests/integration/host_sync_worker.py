"""One rank of test_host_syncs.py: a real `harness.train` run that records every host sync.

Counted: each read of a tensor's value by the host (`item`, `tolist`, `float`, `int`, `bool`),
named by the module and function that read it, and each call of a `Collectives` method that returns a host
value (a blocking collective at world > 1: `sum`, `mean`, `any`, `all`, `all_reduce_min_int`,
`gather_object`, `barrier`; the outermost call only, its own reads inside it not again). `Observer.log_step(step, ...)` marks the end
of each step's record. Writes `<out>/rank<r>.json`: a list of steps, each the list of its syncs.
"""

from __future__ import annotations

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from launching import run_rank

from harness.distributed import Collectives
from harness.observability import Observer

TENSOR_READS = ("item", "tolist", "__float__", "__int__", "__bool__")
HOST_COLLECTIVES = ("sum", "mean", "any", "all", "all_reduce_min_int", "gather_object", "barrier")


def record(out: str, argv: list[str]) -> None:
    syncs: list[str] = []
    steps: list[list[str]] = []
    depth = {"collective": 0}

    def tensor_read(name: str, original):
        @functools.wraps(original)
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if depth["collective"] == 0:  # a collective's own reads are part of it
                syncs.append(f"{caller.f_globals.get('__name__')}:{caller.f_code.co_name}:{name}")
            return original(self, *args, **kwargs)

        return read

    def collective(name: str, original):
        @functools.wraps(original)
        def call(self, *args, **kwargs):
            if depth["collective"] == 0:
                syncs.append(f"collective:{name}")
            depth["collective"] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth["collective"] -= 1

        return call

    for name in TENSOR_READS:
        setattr(torch.Tensor, name, tensor_read(name, getattr(torch.Tensor, name)))
    for name in HOST_COLLECTIVES:
        setattr(Collectives, name, collective(name, getattr(Collectives, name)))
    log_step = Observer.log_step

    def marked(self, step, metrics):
        log_step(self, step, metrics)
        steps.append(list(syncs))
        syncs.clear()

    Observer.log_step = marked
    from harness.train import main

    code = main(argv)
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(steps, f)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    run_rank(record, sys.argv[1], sys.argv[2:])
