"""A uniform view of each target weight's local shard and gradient shard.

A target is a Linear's weight, or a mixture-of-experts layer's stacked expert tensor
(transformers 5 holds a layer's experts as one `[experts, out, in]` parameter per projection,
gpt-oss as `[experts, in, out]`): pruned as the matrix `[experts x out, in]` it is in memory,
so each expert's rows are pruned like a Linear's, and every engine's flat range of it (FSDP2's
whole experts, ZeRO's cut anywhere) is a range of that matrix.

The pruning algorithms are written once against `ShardView`: "this rank holds the flat
range [start, end) of the row-major weight; here are those weights (and the fp32 master
copy, if the engine keeps one), and here is the gradient of that range, already reduced
across ranks". How the range is stored is the engine's business: each view wraps the
engine's `ParamShard` (`harness.engine.shard_of`). Where every rank holds the whole weight
(one process, DDP, ZeRO-1/2's working copy), ranks *share the scoring* by splitting each
matrix evenly, as ZeRO would, and an all-gather of the changed ranges keeps the replicas
identical.

No view ever materialises another rank's weights or gradients.

Why not `Engine.shards()`: that lists every parameter as this rank stores it; pruning wants the
target Linears only, a replica's work split across ranks (`split`), and bare modules as well as
engines. Both call the engine's `shard_of`, the one place that knows the storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.distributed import Collectives
from harness.engine import ParamShard, gradient_probe, shard_of
from harness.memory import clean_fqn
from harness.models import decoder_blocks, stacked_expert_weights
from harness.pruning.layout import FlatRange, Layout, even_ranges, gather_ranges


@dataclass
class Target:
    name: str  # a Linear's qualified name, or a stacked expert tensor's, under the unwrapped model (every strategy's)
    module: nn.Module  # the Linear, or the experts module holding the tensor
    unit: int  # decoder block index (non-block linears: one extra unit after the last block)
    attr: str = "weight"  # the parameter's name on `module`
    experts: int = 0  # a stacked expert tensor's expert count (dim 0); 0: a Linear's weight
    transposed: bool = False  # stacked as [experts, in, out] (transformers' `is_transposed`): rows are inputs

    @property
    def param(self) -> nn.Parameter:
        return getattr(self.module, self.attr)

    @property
    def param_name(self) -> str:
        """The parameter's qualified name (the Linear's `<name>.weight`, the stacked tensor's own)."""
        return f"{self.name}.weight" if not self.experts else self.name

    @property
    def rows_are_outputs(self) -> bool:
        """Whether a row of the matrix in memory is one output's weights (per-row and N:M rules need it)."""
        return not self.transposed


def stacked_experts(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, experts module, attribute) of every stacked expert weight whose layout is
    known: the modules transformers' `use_experts_implementation` made (it sets `is_transposed`)."""
    return [(clean_fqn(f"{name}.{attr}"), m, attr) for name, m, attr in stacked_expert_weights(module) if hasattr(m, "is_transposed")]


def find_targets(module: nn.Module, targets: str) -> list[Target]:
    """The weights to prune: the Linears (and stacked expert tensors) inside decoder blocks, or
    every Linear as well.

    Embeddings are never targets (they are not Linear). A Linear whose weight is shared
    with another module (a tied LM head) is refused rather than silently pruning the
    embedding through it.
    """
    if targets not in ("decoder_linears", "all_linears"):
        raise ValueError(f"targets={targets!r}: expected decoder_linears or all_linears")
    blocks = decoder_blocks(module)
    unit_of = {id(b): i for i, b in enumerate(blocks)}
    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    out: list[Target] = []
    block_prefixes = {}
    for name, m in module.named_modules():
        if id(m) in unit_of:
            block_prefixes[name + "."] = unit_of[id(m)]
    for name, m in module.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        unit = next((u for prefix, u in block_prefixes.items() if name.startswith(prefix)), None)
        if unit is None and targets == "decoder_linears":
            continue
        if owners.get(id(m.weight), 0) > 1:
            raise ValueError(f"{name}.weight is shared with another module (tied weights); prune with targets=decoder_linears")
        out.append(Target(clean_fqn(name), m, len(blocks) if unit is None else unit))  # as if no AC/compile wrapper
    unit_by_name = {clean_fqn(prefix): u for prefix, u in block_prefixes.items()}
    for name, m, attr in stacked_experts(module):
        unit = next((u for prefix, u in unit_by_name.items() if name.startswith(prefix)), None)
        if unit is not None:  # experts live in decoder blocks
            p = getattr(m, attr)
            experts = int(getattr(p, "ds_shape", p.shape)[0])  # ZeRO-3 holds a placeholder: its full shape is ds_shape
            out.append(Target(name, m, unit, attr, experts=experts, transposed=bool(m.is_transposed)))
    if any(t.experts for t in out):  # block by block (stable: a block's Linears, then its experts)
        out.sort(key=lambda t: t.unit)
    return out


@dataclass
class ShardView(FlatRange):
    """This rank's piece of one target weight: the engine's shard of it, plus the ranges of all ranks."""

    target: Target
    shard: ParamShard
    layout: Layout | None = None  # set once every rank's range is known

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def param(self) -> nn.Parameter:
        return self.target.param

    @property
    def storage(self) -> str:
        """How the engine stores the range (replicated | dtensor | zero3 | zero12): for reports and tests."""
        return self.shard.storage

    @property
    def rows(self) -> int:
        """Rows of the matrix in memory (a stacked expert tensor's: experts x its dim 1)."""
        return math.prod(self.shard.shape[:-1])

    @property
    def cols(self) -> int:
        return self.shard.shape[-1]

    @property
    def start(self) -> int:
        return self.shard.start

    @property
    def end(self) -> int:
        return self.shard.end

    @property
    def replicated_lp(self) -> bool:
        """Whether every rank holds the full working weight (writes must be re-gathered)."""
        return self.shard.replicated_working

    # ------------------------------------------------------------------ reading

    @torch.no_grad()
    def lp(self) -> torch.Tensor:
        """A writable 1-D view of the working (forward) weights of this rank's range."""
        return self.shard.working()

    def master(self) -> torch.Tensor | None:
        """The fp32 master copy of this rank's range, where the engine keeps a separate one."""
        return self.shard.master()

    def weight(self) -> torch.Tensor:
        """fp32 weights of this rank's range, for scoring (the master copy where there is one)."""
        m = self.master()
        return (m if m is not None else self.lp()).detach().float()

    @torch.no_grad()
    def grad(self) -> torch.Tensor:
        """fp32 gradient of this rank's range, reduced across ranks (zeros if the weight got none)."""
        g = self.shard.grad()
        if g is None:
            return torch.zeros(self.local_numel, dtype=torch.float32, device=self.lp().device)
        if g.numel() != self.local_numel:
            raise RuntimeError(f"{self.name}: local gradient has {g.numel()} elements, range has {self.local_numel}")
        return g.detach().float()

    @property
    def feature_count(self) -> int:
        """The length of the target's flat input statistics, which `features` indexes: a Linear's
        columns; a stacked expert tensor's experts x inputs."""
        t = self.target
        if not t.experts:
            return self.cols
        return self.rows if t.transposed else t.experts * self.cols

    def features(self, device: torch.device) -> torch.Tensor:
        """For each weight of this rank's range, its input feature's index in the target's flat
        input statistics (`InputStats.sumsq`): a Linear's column; a stacked expert tensor's
        (expert, input) pair, `expert x inputs + input`, since each expert sees its own tokens."""
        flat = torch.arange(self.start, self.end, device=device)
        t = self.target
        if not t.experts:
            return flat % self.cols
        per_expert = self.numel // t.experts
        if t.transposed:  # [experts, in, out]: a row is one input of one expert
            return flat // self.cols
        return (flat // per_expert) * self.cols + flat % self.cols

    # ------------------------------------------------------------------ writing

    def write(self, mask: torch.Tensor | slice, values: torch.Tensor | float, master: bool) -> None:
        """Set weights of this rank's range at `mask` (working copy, and fp32 master if asked;
        `slice(None)`: the whole range, a plain copy).

        Replicated working copies are re-synchronised by `sync_views` afterwards.
        """
        self.shard.write(mask, values, master)


def gather_full(view: ShardView, local: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """The whole matrix of a per-range tensor (only for replicated weights, where each rank
    holds the full weight anyway and needs, e.g., the full mask to apply)."""
    assert view.layout is not None
    lengths = [b - a for a, b in view.layout.ranges]
    pieces = comm.all_gather_varlen(local.reshape(-1), lengths)
    full = torch.empty(view.numel, dtype=local.dtype, device=local.device)
    for (a, b), piece in zip(view.layout.ranges, pieces):
        full[a:b] = piece
    return full


@torch.no_grad()
def sync_views(views: list[ShardView], comm: Collectives) -> None:
    """Make every rank's working weights agree again after `write` calls.

    Replicated copies: all-gather each rank's range. Sharded parameters that the engine keeps
    whole for now (ZeRO-3's gathered ones) are re-gathered from the ranks' ranges.
    Collective: call with the same views on every rank.
    """
    for v in views:
        if v.replicated_lp and not comm.distributed:
            continue  # one process: the range written is the whole copy's own storage
        full = v.shard.full_working()
        if full is not None:
            full.view(-1).copy_(gather_full(v, v.lp().detach().clone(), comm))
            if v.storage == "replicated":
                torch.autograd.graph.increment_version(v.param)  # as `ParamShard.write` does


def build_views(model_or_engine: Any, targets: str, comm: Collectives) -> list[ShardView]:
    """A ShardView per target, in a deterministic order identical on every rank."""
    module = gradient_probe(model_or_engine).module  # the user's model, whatever wraps it (a harness Engine too)
    views = []
    split = lambda numel: even_ranges(numel, comm.world)[comm.rank]  # replicas: the ranks share the scoring
    for t in find_targets(module, targets):
        shard = shard_of(t.param, t.param_name, comm.world, split)
        if len(shard.shape) != (3 if t.experts else 2):
            kind = "3-D stacked expert" if t.experts else "2-D Linear"
            raise ValueError(f"{t.param_name}: expected a {kind} weight, got shape {shard.shape}")
        views.append(ShardView(t, shard))
    for v, ranges in zip(views, gather_ranges([(v.start, v.end) for v in views], comm)):
        v.layout = Layout(v.rows, v.cols, v.start, v.end, ranges)
    return views


def snapshot_views(views: list[ShardView]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Copies of every view's local working weights and fp32 master, for an exact rollback."""
    out = []
    for v in views:
        m = v.master()
        out.append((v.lp().detach().clone(), None if m is None else m.detach().clone()))
    return out


def restore_views(views: list[ShardView], snap: list[tuple[torch.Tensor, torch.Tensor | None]], comm: Collectives) -> None:
    """Put a `snapshot_views` result back (collective: re-syncs replicated copies)."""
    for v, (lp, master) in zip(views, snap):
        v.write(slice(None), master if master is not None else lp, master=master is not None)
        if master is not None:  # the working copy may be lower precision than the master
            v.lp().copy_(lp)
    sync_views(views, comm)
