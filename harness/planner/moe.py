"""Mixture-of-experts models in the trace: the grouped GEMM as the trainer's kernels run it, and routing stated.

**The kernel.** transformers 5 computes a model's experts with ``experts_implementation="grouped_mm"``
by default: the step's ``tokens x top_k`` (token, expert) rows sorted by expert, then one
``torch.nn.functional.grouped_mm`` (``aten._grouped_mm``) per projection, forward and backward. Its
CPU kernel and CUDA's (a CUTLASS kernel for bf16 on SM90/SM100, a loop of ``mm_out`` otherwise) take
fp32, bf16 and fp16 alike, and both make their output the same way (``create_grouped_gemm_output_tensor``
in ATen's GroupedMMUtils.h: mat_a's dtype, the last dimension's stride padded to 16 bytes). torch's
meta kernel, which fake tensors run, asserts bf16 (it copies the checks of CUDA's kernel, which now
falls back to ``mm_out`` for other dtypes instead), so an fp32 or fp16 step could not be traced.
:class:`GroupedMMAsRun` answers the op for the trace with the output the real kernels allocate;
every other op, and the op's autograd formula (its backward is grouped GEMMs too), is torch's own.

**Routing.** What the router decides is data; a fake tensor has none. Under ``grouped_mm`` (and
``batched_mm``) no shape depends on it: every (token, expert) row is a row of one matrix whatever
expert it goes to, and a fake-tensor trace that ends proves it, since any op whose output shape comes
from values (``nonzero``, ``torch.where(mask)``, ``.item()``) raises under fake tensors. So one trace
holds for every routing, and the report says so beside both cases (:class:`Routing`): the worst
(every token of a micro-batch to the same ``top_k`` experts, so each of them gets all its tokens; one
expert per layer under top-1) and the balanced (each expert ``tokens x top_k / experts`` rows). An
implementation whose shapes follow the routing (``eager``: a loop over the experts hit, each with
its own tokens) is refused in one line, before tracing (:func:`untraceable`).

**Expert parallelism.** Split over ``N`` ranks (``parallel.expert``), a rank holds ``E / N`` experts
of every layer and computes the rows the ``N`` ranks of its expert group send it, so here the
routing does change the bytes: transformers' dispatch reads the split sizes back from the routing
(one ``.tolist()`` a layer), which a fake tensor cannot answer. The trace splits the experts with
transformers' own plan, as the trainer does, and runs its dispatch unchanged under
:class:`PlannedExchange`, which answers those reads with the case's sizes (:func:`exchange_sizes`):
in the worst case every token of the group goes to this rank's experts (``N x tokens x min(top_k,
E / N)`` rows received), in the balanced one each rank receives what it sends. The two cases are
traced apart and both peaks reported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from harness.config import RunConfig
from harness.models import empty_model, expert_count, model_config

ROUTINGS = ("worst", "balanced")  # the routing case a plan's verdict uses (`harness.plan --routing`)
ROUTING_FREE = ("grouped_mm", "batched_mm")  # experts implementations whose shapes no routing changes
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what ATen's _grouped_mm_validate_inputs takes


@dataclass(frozen=True)
class MoeFacts:
    """The experts of a model, as transformers built them."""

    layers: int  # experts modules (one per MoE layer)
    experts: int  # per layer
    top_k: int  # experts per token
    implementation: str  # config._experts_implementation


def moe_facts(model: nn.Module) -> MoeFacts | None:
    """The model's experts (modules made by transformers' ``use_experts_implementation``), or None."""
    experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]
    if not experts:
        return None
    config = getattr(model, "config", None)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "top_k", 0) or 1)
    implementation = str(getattr(config, "_experts_implementation", None) or "grouped_mm")
    return MoeFacts(len(experts), int(experts[0].num_experts), top_k, implementation)


@functools.cache
def _experts_per_layer(model_name: str) -> int | None:
    """The model's experts per MoE layer by its expert plan (`harness.models.expert_count`, on the meta
    device); None: a dense model, one without an expert plan, or a name whose config cannot be read
    (the estimate itself then says why)."""
    try:
        return expert_count(empty_model(model_config(model_name)))
    except Exception:
        return None


def expert_degree(cfg: RunConfig, world: int) -> int:
    """The expert-parallel degree a plan offers: the user's, or else the largest that divides both the
    world and the model's experts per layer (the fewest experts a rank can hold); 1 where there is
    nothing to split (a dense model, one rank)."""
    if cfg.parallel.expert > 1:
        return cfg.parallel.expert
    count = _experts_per_layer(cfg.model.name) if world > 1 else None
    if not count:
        return 1
    return max(d for d in range(1, world + 1) if world % d == 0 and count % d == 0)


def untraceable(facts: MoeFacts | None, model_name: str) -> str | None:
    """Why the step cannot be traced, in one line, when the experts' shapes follow the routing; else None."""
    if facts is None or facts.implementation in ROUTING_FREE:
        return None
    return (
        f"model '{model_name}' computes its experts with experts_implementation '{facts.implementation}', whose tensors "
        "take their shapes from where the router sends each token (a fake-tensor trace has no values to route by); "
        "the planner traces grouped_mm (transformers' default) and batched_mm, whose shapes no routing changes: "
        "remove experts_implementation from the model's config.json, or set it to grouped_mm"
    )


def grouped_mm_output(
    mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None, bias: Any = None, out_dtype: Any = None
) -> torch.Tensor:
    """The output ``aten._grouped_mm`` allocates on CPU and CUDA (ATen's ``create_grouped_gemm_output_tensor``)."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype not in GROUPED_MM_DTYPES:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
    if (out_dtype or mat_a.dtype) != mat_a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        assert offs is not None
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    align = 16 // mat_a.element_size()
    padded = -(-size[-1] // align) * align
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=mat_a.dtype, device=mat_a.device)


class GroupedMMAsRun(TorchDispatchMode):
    """Entered inside the trace's FakeTensorMode, below the tracker: ``aten._grouped_mm`` gets the
    real kernels' output (a fake tensor of that shape, stride and dtype); every other op passes."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._grouped_mm.default:
            return grouped_mm_output(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def exchange_sizes(case: str, tokens: int, top_k: int, experts: int, degree: int) -> tuple[list[int], list[int]]:
    """The rows rank 0 of an expert group of ``degree`` ranks sends to each rank and receives from
    each, in ``case``, for one MoE layer of ``experts`` experts (``degree`` consecutive ranges)."""
    rows, local = tokens * top_k, experts // degree
    if case == "worst":  # every rank's tokens to as many of rank 0's experts as each token can pick
        mine = tokens * min(top_k, local)
        rest = rows - mine  # the token's other choices, on the next ranks (what rank 0 sends away)
        send = [mine] + [rest // (degree - 1) + (i < rest % (degree - 1)) for i in range(degree - 1)]
        return send, [mine] * degree
    even = [rows // degree + (i < rows % degree) for i in range(degree)]
    return even, list(even)


class PlannedExchange(TorchDispatchMode):
    """Entered inside the trace's FakeTensorMode: the split sizes transformers' expert dispatch reads
    back from the routing (``aten._local_scalar_dense``, send sizes then receive sizes, a layer at a
    time) are answered with a routing case's (:func:`exchange_sizes`). Nothing else in a traced step
    reads a value: a fake tensor has none, and the step without experts split traces to its end."""

    def __init__(self, send: list[int], recv: list[int]):
        super().__init__()
        self.sizes = [*send, *recv]
        self.read = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            value = self.sizes[self.read % len(self.sizes)]
            self.read += 1
            return value
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class Routing:
    """Where a micro-batch's tokens go in each MoE layer, as a plan assumes it, and what that changes."""

    facts: MoeFacts
    tokens: int  # tokens of one micro-batch on this rank (its sequence slice under sequence parallelism)
    assumed: str = "worst"  # the case the verdict uses (ROUTINGS)
    expert: int = 1  # ranks the experts are split over (parallel.expert)
    peaks: tuple[tuple[str, int], ...] = ()  # under expert parallelism: each case's own traced peak

    @property
    def rows(self) -> int:
        return self.tokens * self.facts.top_k

    def received(self, case: str) -> int:
        """(token, expert) rows this rank's experts compute in a layer (all of its own without expert parallelism)."""
        if self.expert == 1:
            return self.rows
        return sum(exchange_sizes(case, self.tokens, self.facts.top_k, self.facts.experts, self.expert)[1])

    def busiest(self, case: str) -> int:
        """Rows the busiest expert of a layer gets in ``case``."""
        if case == "worst":
            return self.tokens * self.expert  # top-k experts are distinct: at most every token of the group once
        return -(-self.rows * self.expert // self.facts.experts)

    def describe(self, case: str) -> str:
        k, e, n = self.facts.top_k, self.facts.experts, self.expert
        if case == "worst" and n > 1:
            return (
                f"every token of the {n} ranks of an expert group to this rank's {e // n} experts in every layer "
                f"({self.received(case):,} rows received)"
            )
        if case == "worst":
            to = "the same expert" if k == 1 else f"the same {k} experts"
            return f"every token of a micro-batch to {to} in every layer ({self.tokens:,} rows each, {e - k} experts idle)"
        rows = self.rows * n
        share = f"{rows // e:,}" if rows % e == 0 else f"{rows / e:,.1f}"
        group = f" of the {n} ranks' {rows:,}" if n > 1 else f" of the {rows:,}"
        return f"each of the {e} experts {share}{group} (token, expert) rows in every layer"

    def peak(self, case: str, verdict_peak: int) -> int:
        """The per-rank peak in ``case``: one trace for both without expert parallelism, each its own with it."""
        return dict(self.peaks).get(case, verdict_peak)

    def why_equal(self) -> str:
        if self.expert > 1:
            return (
                f"the bytes differ: split over {self.expert} ranks, this rank computes the rows the others send it, "
                f"{self.received('balanced'):,} a layer balanced and {self.received('worst'):,} in the worst case; "
                "each case is its own trace, with transformers' dispatch told the case's split sizes"
            )
        return (
            f"the same bytes in both: {self.facts.implementation} computes a layer's {self.rows:,} (token, expert) rows as one "
            "batch however they are split among the experts; a fake-tensor trace stops at any shape taken from a value, "
            "and this one ran to its end, so it holds for every routing"
        )


__all__ = [
    "GROUPED_MM_DTYPES",
    "ROUTINGS",
    "ROUTING_FREE",
    "GroupedMMAsRun",
    "MoeFacts",
    "PlannedExchange",
    "Routing",
    "exchange_sizes",
    "expert_degree",
    "grouped_mm_output",
    "moe_facts",
    "untraceable",
]
