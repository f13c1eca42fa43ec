"""torch.compile of the model (per decoder block or whole), its activation memory budget,
and compile time kept apart from step time.

- ``block``: each decoder block is compiled on its own (torchtitan's choice). Identical
  blocks share one compiled graph (parameters are graph inputs), so compile time does not
  grow with depth, and each block stays a separate module for FSDP2 / AC wrappers.
- ``model``: the whole HF model is compiled in one graph (as the Peak Memory study did);
  longer compile, more fusion across block boundaries.

Both compile *in place* (``nn.Module.compile``): no ``_orig_mod.`` in parameter names,
the same module objects for ``fully_shard``, state dicts unchanged. FSDP2 hooks added
afterwards are skipped by dynamo (``torch._dynamo.config.skip_fsdp_hooks``) and run eagerly.

Blocks compiled inside activation checkpointing: dynamo refuses a forward side effect under
the checkpoint (it would have to replay it in the backward's recompute) and falls back to eager
for the whole block. transformers' attention sets a module-routing context variable in every
forward (`kernels`' `use_kernelized_func`, transformers 5.25) and its output capture appends to
lists from hooks, so with AC nothing compiled at all. ``apply_compile`` sets
``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` (as torchtitan does when
it compiles): the forward's side effects happen once, in the forward, which is what these
set-and-reset routings and captures mean. Process-wide, like the budget below. A mixture-of-experts
block is the exception: its router's capture hook cannot be traced at all, so a checkpointed MoE
block is compiled below the checkpoint instead (`compile_around`).

The activation memory budget is ``torch._functorch.config.activation_memory_budget``: the
min-cut partitioner saves the activations that fit into ``budget`` x (what would be
saved without recomputation) and recomputes the rest, choosing by a knapsack on runtime.
It is a *process-wide* setting read when a graph is compiled (the first step), not when
``torch.compile`` is called, so it is set here and stays set: one run per process, which
is how the experiment runner launches configurations.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from harness.config import COMPILE_MODES
from harness.distributed import wrapper_chain
from harness.models import decoder_block_list
from harness.training import router_class


def set_activation_memory_budget(budget: float | None) -> None:
    """Set (or with ``None`` reset to 1.0, i.e. off) the process-wide activation memory budget."""
    if budget is not None and not 0.0 <= budget <= 1.0:
        raise ValueError(f"activation_memory_budget={budget} must be in [0, 1]")
    functorch_config.activation_memory_budget = 1.0 if budget is None else float(budget)


def apply_compile(
    model: nn.Module, mode: str, memory_budget: float | None = None, *, backend: str = "inductor", fullgraph: bool = False
) -> str:
    """Compile ``model`` in place per ``mode``; returns the mode applied.

    Call after activation checkpointing and before ``fully_shard``. A ``memory_budget``
    with ``mode='none'`` compiles the whole model (the budget only exists in compiled
    graphs). ``backend='aot_eager_decomp_partition'`` runs the same partitioner without
    inductor's code generation (fast; used by tests).
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile={mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if memory_budget is not None and mode == "none":
        mode = "model"
    set_activation_memory_budget(memory_budget)
    if mode == "none":
        return mode
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # module docstring (torch 2.13 has it)
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if mode == "model":
        model.compile(backend=backend, fullgraph=fullgraph)
        return mode

    router = router_class(model)
    for block in decoder_block_list(model):
        if router is not None and any(isinstance(m, CheckpointWrapper) for m in wrapper_chain(block)):
            compile_around(block, router, backend=backend, fullgraph=fullgraph)
        else:
            block.compile(backend=backend, fullgraph=fullgraph)
    return mode


def compile_around(module: nn.Module, keep_eager: type, *, backend: str, fullgraph: bool) -> None:
    """Compile the largest submodules of `module` that hold no `keep_eager` module, each in place.

    A checkpointed MoE block compiled whole runs eagerly: its router's output-capture hook reads
    transformers' collector `ContextVar`, which dynamo cannot trace, and a graph break inside the
    checkpoint gives up the whole checkpointed region. Compiled below the checkpoint, attention and
    the experts are graphs of their own (a hook of theirs breaks after their forward), called by the
    eager checkpoint in the forward and again in its recompute; the router stays eager."""
    for child in module.children():
        if isinstance(child, keep_eager):
            continue
        if any(isinstance(m, keep_eager) for m in child.modules()):
            compile_around(child, keep_eager, backend=backend, fullgraph=fullgraph)
        elif next(child.parameters(), None) is not None:
            child.compile(backend=backend, fullgraph=fullgraph)


def _graphs_compiled() -> int:
    return int(counters["stats"].get("unique_graphs", 0))


class CompiledCheck:
    """Whether the first forward after a compile compiled anything: dynamo falls back to eager, with
    no error, where it cannot trace (a graph break it cannot split at, such as a side effect inside
    activation checkpointing, is a whole block run eagerly). Built by the engine before its first forward;
    `fell_back()` after the first forward is None, or one line saying what ran eagerly and why
    (dynamo's first recorded graph break)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.before = mode, _graphs_compiled()

    def fell_back(self) -> str | None:
        if _graphs_compiled() > self.before:
            return None
        breaks = [*counters["graph_break"], *counters["unimplemented"]]
        why = str(breaks[0]).strip().splitlines()[0] if breaks else "dynamo recorded no reason"
        return f"memory.compile={self.mode}: the first forward compiled no graph, so the model runs eagerly ({why})"


class CompileTimer:
    """Separate compile warm-up from steady step time.

    Wrap every training step in :meth:`step`. A step during which dynamo compiled a new
    graph (first step, a recompile after a shape change) is a warm-up step; its excess
    over the median steady step is compile time. Samples/s for reports should use
    :meth:`report`'s ``steady_step_s`` / ``steady_wall_s``, never the warm-up steps.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.compiled: list[bool] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        before = _graphs_compiled()
        start = time.perf_counter()
        yield
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        self.compiled.append(_graphs_compiled() > before)

    def report(self) -> dict[str, Any]:
        steady = [t for t, c in zip(self.times, self.compiled) if not c]
        warm = [t for t, c in zip(self.times, self.compiled) if c]
        steady_step = statistics.median(steady) if steady else None
        compile_s = sum(t - (steady_step or 0.0) for t in warm) if warm else 0.0
        return {
            "warmup_steps": len(warm),
            "compile_s": compile_s if steady_step is not None or not warm else None,  # unknown without a steady step
            "warmup_wall_s": sum(warm),
            "steady_steps": len(steady),
            "steady_step_s": steady_step,
            "steady_wall_s": sum(steady),
        }


__all__ = ["CompileTimer", "apply_compile", "set_activation_memory_budget"]
