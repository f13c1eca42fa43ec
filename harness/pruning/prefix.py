"""The forward below the probed blocks, computed once and replayed while it cannot change.

A probe pass needs the loss, so it runs the whole model forward, yet the blocks below the
lowest probed one see the same micro-batches through the same weights in every pass that
probes that block: G0 and G1 of one group, and, in GradProbe's original mode, the 14 passes
over one block's 7 matrices. `PrefixCache` keeps the output of the block just below the
lowest probed one for every calibration micro-batch (captured in the first such pass) and,
in the later passes, has every block below return it instead of computing. With the
backward restricted to the probed weights (`Runner`), nothing below is then run at all.

When a replay is exact, and when it is not attempted:
- the key is the lowest probed block plus the version counter of every parameter below it:
  any in-place write to those weights (the engine's shard writes bump it too) starts a new
  capture. Micro-batches are known by identity: the runner's calibration list is fixed.
- the first replay of a run is checked against a full forward of the same micro-batch (bit
  for bit); a model whose blocks do not form a plain chain (each block's output feeding only
  the next) fails the check, and the cache turns itself off for the run.
- compiled blocks or models (a changed forward would recompile) and models without a decoder
  block list are never replayed; neither is a capture larger than a quarter of the memory
  available when it is taken.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from harness.models import BlocksNotFound, decoder_blocks

log = logging.getLogger(__name__)

# Share of the memory available at capture time the replayed outputs may hold.
CAPTURE_FRACTION = 0.25


def _detached(out: Any) -> Any:
    return tree_map(lambda x: x.detach() if torch.is_tensor(x) else x, out)


def _nbytes(out: Any) -> int:
    return sum(x.numel() * x.element_size() for x in tree_flatten(out)[0] if torch.is_tensor(x))


def _compiled(module: nn.Module) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod") for m in module.modules())


class PrefixCache:
    """Per micro-batch, the output of the block below the lowest probed one (see the module docstring)."""

    def __init__(self, module: nn.Module, available_bytes: Callable[[], int]) -> None:
        try:
            self.blocks = decoder_blocks(module)
        except BlocksNotFound:
            self.blocks = []
        self.enabled = bool(self.blocks) and not _compiled(module)
        self.available_bytes = available_bytes
        self.verified = False
        self.key: tuple[Any, ...] | None = None
        self.outputs: dict[int, Any] = {}
        self.nbytes = 0
        self.replays = 0  # micro-batches whose lower blocks were not computed (counted by the runner)

    def _key(self, lowest: int) -> tuple[Any, ...]:
        below = [p for b in self.blocks[:lowest] for p in b.parameters()]
        return (lowest, tuple((id(p), p._version) for p in below))

    def usable(self, lowest: int) -> bool:
        return self.enabled and 0 < lowest <= len(self.blocks)

    def has(self, batch: Any, lowest: int) -> bool:
        """Whether `batch`'s prefix up to `lowest` is cached and still valid (drops a stale one)."""
        if not self.usable(lowest):
            return False
        key = self._key(lowest)
        if key != self.key:
            self.drop()
            self.key = key
        return id(batch) in self.outputs

    def drop(self) -> None:
        self.key, self.outputs, self.nbytes = None, {}, 0

    def disable(self, why: str) -> None:
        self.enabled = False
        self.drop()
        log.warning("prune: the probe passes recompute every block from here on (%s)", why)

    @contextlib.contextmanager
    def capturing(self, batch: Any, lowest: int) -> Iterator[None]:
        """Run a forward as is, keeping the output of block `lowest - 1` for `batch`."""
        if not self.usable(lowest):
            yield
            return

        def keep(_module: nn.Module, _args: Any, out: Any) -> None:
            self.outputs[id(batch)] = _detached(out)
            self.nbytes += _nbytes(out)

        handle = self.blocks[lowest - 1].register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()
        if self.nbytes > CAPTURE_FRACTION * self.available_bytes():
            held = self.nbytes / 2**20
            self.disable(f"the captured block outputs, {held:.0f} MiB, exceed {CAPTURE_FRACTION:.0%} of the memory available")

    @contextlib.contextmanager
    def replaying(self, batch: Any, lowest: int) -> Iterator[None]:
        """Every block below `lowest` returns the cached output of block `lowest - 1` for `batch`."""
        out = self.outputs[id(batch)]
        replay = lambda *_args, **_kwargs: out
        patched = self.blocks[:lowest]
        own = [b.__dict__.get("forward") for b in patched]
        for b in patched:
            b.forward = replay
        try:
            yield
        finally:
            for b, f in zip(patched, own):
                if f is None:
                    del b.forward
                else:
                    b.forward = f
