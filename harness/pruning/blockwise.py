"""Pruning one decoder block at a time, each block measured on the outputs of the blocks already
pruned: the sequential order of SparseGPT's and Wanda's reference code, and the order in which
`sparsegpt_fit` fits each block.

Why streamed: a method that prunes in this order must measure block i on what the pruned blocks
below it produce. Running the whole model once per block does that at L times the cost, and
grouping several blocks per pass to save time (chosen from free memory) made the Hessians, and so
the result, depend on how much memory the machine had. Here the calibration set goes through the
model once to capture block 0's inputs, then through each block twice: dense (its statistics,
and the targets of a fit), and again once pruned (the next block's inputs).

Each block is called with its own arguments, as the model's forward hands them: models whose
layers differ in attention type (Gemma 3's sliding-window and global layers, transformers'
`config.layer_types`) give each layer its own mask and rotary embedding, so block 0's arguments
replayed for every block would compute later blocks on the wrong attention. The arguments are
captured from one forward of every calibration micro-batch (references to the model's own
tensors, shared between blocks where the model shares them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.distributed import Collectives
from harness.models import decoder_blocks
from harness.pruning.calibration import InputStats, Ledger, Runner, forward_pass
from harness.pruning.shards import ShardView

KV_CACHE_KEYS = ("cache", "past_key_values", "past_key_value", "layer_past")


@dataclass(frozen=True)
class BlockCall:
    """How the model called one block for one micro-batch, less its hidden states."""

    args: tuple[Any, ...]  # positional arguments after the hidden states
    kwargs: dict[str, Any]

    def __call__(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        out = block(hidden, *self.args, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


class _Captured(Exception):
    """Ends a forward once every block's arguments are captured (whole models only)."""


def _replayable(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The block's keyword arguments without a key/value cache (a replayed call would grow it)."""
    out = {k: (None if k in KV_CACHE_KEYS else v) for k, v in kwargs.items() if k != "hidden_states"}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def capture_block_calls(
    runner: Runner, batches: list[Any], blocks: list[nn.Module], stop_early: bool
) -> tuple[list[torch.Tensor], list[list[BlockCall]]]:
    """(block 0's hidden states per micro-batch, every block's call per micro-batch: [block][batch]).

    `stop_early` raises out of the forward at the last block's call (whole models: the head and
    the last block are skipped); sharded engines run each forward to its end, so that their
    own hooks see complete passes."""
    hidden: list[torch.Tensor] = []
    calls: list[list[BlockCall]] = [[] for _ in blocks]
    last = len(blocks) - 1

    def hook(i: int) -> Callable[..., None]:
        def grab(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if i == 0:
                hidden.append((args[0] if args else kwargs["hidden_states"]).detach())
            calls[i].append(BlockCall(tuple(args[1:]), _replayable(kwargs)))
            if stop_early and i == last:
                raise _Captured

        return grab

    handles = [b.register_forward_pre_hook(hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        for batch in batches:
            runner._check_stop()
            try:
                with torch.no_grad():
                    runner.loss_fn(runner.target, batch)
            except _Captured:
                pass
            runner.fwd_batches += last / len(blocks) if stop_early else 1
    finally:
        for h in handles:
            h.remove()
    if any(len(c) != len(batches) for c in calls):
        counts = sorted({len(c) for c in calls})
        raise RuntimeError(
            f"the decoder blocks were called {counts} times for {len(batches)} calibration micro-batches: the model does not "
            "call each block once per forward, so it cannot be pruned block by block (prune.method=wanda with prune.sequential=false can)"
        )
    return hidden, calls


@dataclass
class Block:
    """One decoder block's turn: its targets, its inputs from the pruned blocks below, and (after
    the dense pass) its statistics and, when asked, its dense outputs."""

    index: int
    module: nn.Module | None  # None: the Linears outside the decoder blocks (targets=all_linears)
    views: list[ShardView]
    inputs: list[torch.Tensor]
    calls: list[BlockCall]
    stats: InputStats
    runner: Runner  # asked for a stop before each micro-batch, and counting the passes
    outputs: list[torch.Tensor] | None = None

    def run(self, inputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The block (as its weights are now) on `inputs` (default: its own), without gradients."""
        assert self.module is not None
        out = []
        share = 1.0 / len(decoder_blocks(self.runner.module))  # one block on one micro-batch: this share of a pass
        with torch.no_grad():
            for h, call in zip(self.inputs if inputs is None else inputs, self.calls):
                self.runner._check_stop()
                out.append(call(self.module, h))
                self.runner.fwd_batches += share
        return out


PruneBlock = Callable[[Block], dict[str, torch.Tensor]]  # one block's local masks; its weights written


def stream_blocks(
    runner: Runner,
    batches: list[Any],
    views: list[ShardView],
    comm: Collectives,
    ledger: Ledger,
    prune_block: PruneBlock,
    hessian: bool,
    keep_outputs: bool = False,
) -> dict[str, torch.Tensor]:
    """Prune block after block (see the module docstring); returns this rank's masks. Collective.

    `prune_block` gets each block after its dense pass (statistics finalized across ranks; the
    dense outputs kept when `keep_outputs`), chooses its masks and writes its weights. Linears
    outside the decoder blocks (an untied head under targets=all_linears) come last, measured by
    one forward of the whole pruned model."""
    blocks = decoder_blocks(runner.module)
    n = len(blocks)
    whole = runner.probe.computes_alone([v.param for v in views])  # one process or DDP: the forward may stop early
    hidden, calls = capture_block_calls(runner, batches, blocks, stop_early=whole)
    masks: dict[str, torch.Tensor] = {}
    for u, module in enumerate(blocks):
        mine = [v for v in views if v.target.unit == u]
        block = Block(u, module, mine, hidden, calls[u], InputStats(mine, hessian=hessian, ledger=ledger), runner)
        with block.stats:
            dense = block.run()
        ledger.add("stream/activations", sum(h.numel() * h.element_size() for h in hidden) * (3 if keep_outputs else 2))
        if mine:
            block.stats.finalize(comm)
            block.outputs = dense if keep_outputs else None
            masks.update(prune_block(block))
            del dense
            hidden = block.run()  # the next block's inputs: this block's pruned outputs
        else:
            hidden = dense
        del block
        ledger.drop("stream/")
        ledger.drop("stats/")
    outside = [v for v in views if v.target.unit >= n]
    if outside:
        stats = InputStats(outside, hessian=hessian, ledger=ledger)
        forward_pass(runner, batches, stats)
        stats.finalize(comm)
        masks.update(prune_block(Block(n, None, outside, [], [], stats, runner)))
        ledger.drop("stats/")
    return masks
