"""One rank of a test that watches a real `harness.train` run step by step (test_host_syncs.py,
test_token_weighting.py): it records every host sync and every gradient all-reduce of DDP.

Host syncs: each read of a tensor's value by the host (`item`, `tolist`, `float`, `int`, `bool`),
named by the module and function that read it, and each call of a `Collectives` method that returns a host
value (a blocking collective at world > 1: `sum`, `mean`, `any`, `all`, `all_reduce_min_int`,
`gather_object`, `barrier`; the outermost call only, its own reads inside it not again).

DDP's gradient all-reduces: every `DistributedDataParallel` gets a communication hook (torch's own
`allreduce_hook`, what the reducer does without one) that records each bucket it all-reduces as
`[micro-batch, bucket index]`, the micro-batch counted by the wrapper's forwards with gradients on.

`Observer.log_step(step, ...)` marks the end of each step's record. Writes `<out>/rank<r>.json`:
`{"syncs": [...], "ddp_buckets": [...]}`, per step the list of its syncs and of its buckets.
"""

from __future__ import annotations

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from launching import run_rank
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from harness.distributed import Collectives
from harness.observability import Observer

TENSOR_READS = ("item", "tolist", "__float__", "__int__", "__bool__")
HOST_COLLECTIVES = ("sum", "mean", "any", "all", "all_reduce_min_int", "gather_object", "barrier")


def record(out: str, argv: list[str]) -> None:
    syncs: list[str] = []
    buckets: list[list[int]] = []
    steps: dict[str, list] = {"syncs": [], "ddp_buckets": []}
    depth = {"collective": 0}
    forwards = {"micro": -1}  # this step's DDP forwards with gradients on, less one

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

    def counted_allreduce(group, bucket):
        buckets.append([forwards["micro"], bucket.index()])
        return default_hooks.allreduce_hook(group, bucket)

    ddp_init, ddp_forward = DistributedDataParallel.__init__, DistributedDataParallel.forward

    def init(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        self.register_comm_hook(self.process_group, counted_allreduce)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            forwards["micro"] += 1
        return ddp_forward(self, *args, **kwargs)

    DistributedDataParallel.__init__, DistributedDataParallel.forward = init, forward
    log_step = Observer.log_step

    def marked(self, step, metrics):
        log_step(self, step, metrics)
        steps["syncs"].append(list(syncs))
        steps["ddp_buckets"].append(list(buckets))
        syncs.clear()
        buckets.clear()
        forwards["micro"] = -1

    Observer.log_step = marked
    from harness.train import main

    code = main(argv)
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(steps, f)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    run_rank(record, sys.argv[1], sys.argv[2:])
