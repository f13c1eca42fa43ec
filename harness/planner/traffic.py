"""The bytes a rank sends per step, planned: the traced collectives and the engine's own.

The trace (`harness.planner.trace`) counts what its forwards and backwards dispatch (FSDP2's
gathers and reduce-scatters, the experts' and Ulysses' all-to-alls) with the measurement's own
counter (`harness.distributed.traffic`); the engines the trace does not wrap add theirs here, by
the same volumes. Measured against a real step: tests/integration/test_planner_accuracy.py and
test_planner_moe.py, equal to the byte.
"""

from __future__ import annotations

import collections

from harness.planner.trace import TraceResult


def planned_traffic(trace: TraceResult, kind: str, world: int, grad_accum: int = 1) -> dict[str, int] | None:
    """What this rank sends per step in its forwards and backwards: the traced collectives (FSDP2's,
    the experts' and Ulysses' exchanges) and those of the engine laid over the trace, counted by the
    measurement's rule (`harness.distributed.traffic`). DDP all-reduces every trained gradient but the
    split experts' once a step and broadcasts the buffers from rank 0 once a step too (before the first
    forward: a forward inside `no_sync` leaves the next one unsynced); the split experts are all-reduced
    over their replicas (under FSDP2 they are its groups on the replica mesh: traced). The trace holds
    at most two micro-batches of a step of `grad_accum`: the second stands for every one after the
    first. None for DeepSpeed (not planned)."""
    if kind == "deepspeed":
        return None
    sent: collections.Counter[str] = collections.Counter()
    for i, micro in enumerate(trace.sent):
        repeats = max(1, grad_accum - 1) if i == len(trace.sent) - 1 and i > 0 else 1
        for k, v in micro.items():
            sent[k] += v * repeats
    spec = trace.spec
    if kind == "ddp" and world > 1:
        sent["all_reduce"] += (trace.grad_bytes - trace.split_grad_bytes) * 2 * (world - 1) // world
        sent["broadcast"] += trace.buffer_bytes * (world - 1)
    replicas = world // spec.expert
    if kind == "ddp" and spec.expert > 1 and replicas > 1:
        sent["all_reduce"] += trace.split_grad_bytes * 2 * (replicas - 1) // replicas
    return {k: v for k, v in sent.items() if v}


__all__ = ["planned_traffic"]
