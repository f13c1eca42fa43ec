"""Pruning masks: applying them, keeping pruned weights at exactly zero, saving/loading.

Masks are kept per target as this rank's range only (True = pruned), so their memory is
1 byte x parameters / world. Training after pruning would regrow pruned weights (Adam
updates any weight whose gradient is non-zero), so `MaskEnforcer` re-zeroes them after
every optimizer step: the working copy *and* the fp32 master where the engine keeps one
(DeepSpeed ZeRO), otherwise the master would copy the regrown value back next step.

Saved masks are one file per rank holding its flat range, bit-packed; loading intersects
every file's range with the loading rank's range, so a mask saved at one world size loads
at any other and under any strategy.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

from harness.distributed import Collectives
from harness.pruning.shards import ShardView, build_views, gather_full, sync_views

FILE_GLOB = "prune_masks.rank*.pt"
FORMAT = 1


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool -> uint8, 8 per byte, most significant bit first."""
    flat = mask.reshape(-1).to(torch.uint8).cpu()
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32)
    return (flat.reshape(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Positions [lo, hi) of a `pack_bits` result, as bool."""
    if hi <= lo:
        return torch.zeros(0, dtype=torch.bool)
    chunk = packed[lo // 8 : (hi + 7) // 8].to(torch.int32)
    shifts = torch.arange(7, -1, -1, dtype=torch.int32)
    bits = ((chunk.reshape(-1, 1) >> shifts) & 1).reshape(-1).bool()
    return bits[lo % 8 : lo % 8 + hi - lo]


class MaskSet:
    """This rank's piece of every target's mask, keyed by target name (True = pruned)."""

    def __init__(self, masks: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> None:
        self.masks = masks
        self.meta = dict(meta or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.masks[name]

    def __contains__(self, name: str) -> bool:
        return name in self.masks

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's pieces on the host: what a checkpoint keeps (the Stateful of
        `harness.checkpoint.CheckpointManager.register_masks`)."""
        return {name: m.detach().cpu() for name, m in self.masks.items()}

    @classmethod
    def from_state(cls, saved: dict[str, torch.Tensor], views: list[ShardView]) -> MaskSet:
        """The masks of a checkpoint's `state_dict()`: a mask saved at world 1 is whole, and each
        rank takes its range of it; one saved sharded is this rank's range already."""
        local = {}
        for v in views:
            if v.name in saved:
                m = saved[v.name].reshape(-1)
                local[v.name] = m[v.start : v.end] if m.numel() == v.numel and m.numel() != v.local_numel else m
                if local[v.name].numel() != v.local_numel:
                    raise ValueError(
                        f"resumed pruning mask of {v.name} has {local[v.name].numel()} elements, this rank holds {v.local_numel}"
                    )
        return cls(local)

    def apply(self, views: list[ShardView], comm: Collectives) -> None:
        """Zero the masked weights (working copy and fp32 master). Collective."""
        for v in views:
            m = self.masks.get(v.name)
            if m is not None and m.numel():
                v.write(m.to(v.lp().device), 0.0, master=True)
        sync_views(views, comm)

    def counts(self, views: list[ShardView], comm: Collectives) -> list[tuple[str, int, int]]:
        """(name, pruned, numel) per target, summed over ranks. Collective."""
        local = torch.tensor([int(self.masks[v.name].sum()) if v.name in self.masks else 0 for v in views], dtype=torch.int64)
        total = comm.all_reduce_sum(local)
        return [(v.name, int(n), v.numel) for v, n in zip(views, total)]

    def save(self, directory: str, views: list[ShardView], comm: Collectives) -> str:
        """Write this rank's file (and, on rank 0, a small JSON index). Collective."""
        os.makedirs(directory, exist_ok=True)
        payload = {
            "format": FORMAT,
            "rank": comm.rank,
            "world": comm.world,
            "masks": {
                v.name: {"rows": v.rows, "cols": v.cols, "start": v.start, "end": v.end, "bits": pack_bits(self.masks[v.name])}
                for v in views
                if v.name in self.masks
            },
        }
        path = os.path.join(directory, f"prune_masks.rank{comm.rank:05d}.pt")
        torch.save(payload, path)
        if comm.rank == 0:
            with open(os.path.join(directory, "prune_masks.json"), "w") as f:
                json.dump(
                    {"format": FORMAT, "world": comm.world, "targets": [v.name for v in views], **self.meta}, f, indent=1, default=str
                )
        comm.barrier()
        return path

    @classmethod
    def load(cls, directory: str, views: list[ShardView], comm: Collectives) -> MaskSet:
        """Rebuild this rank's pieces from files written at any world size."""
        files = sorted(glob.glob(os.path.join(directory, FILE_GLOB)))
        if not files:
            raise FileNotFoundError(f"no {FILE_GLOB} in {directory}")
        out = {v.name: torch.zeros(v.local_numel, dtype=torch.bool) for v in views}
        covered = {v.name: 0 for v in views}
        meta: dict[str, Any] = {}
        index = os.path.join(directory, "prune_masks.json")
        if os.path.isfile(index):
            with open(index) as f:
                meta = {k: v for k, v in json.load(f).items() if k not in ("format", "world", "targets")}
        for path in files:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            if payload.get("format") != FORMAT:
                raise ValueError(f"{path}: unknown mask format {payload.get('format')}")
            for v in views:
                entry = payload["masks"].get(v.name)
                if entry is None:
                    continue
                if (entry["rows"], entry["cols"]) != (v.rows, v.cols):
                    raise ValueError(f"{path}: {v.name} is {entry['rows']}x{entry['cols']}, model has {v.rows}x{v.cols}")
                lo, hi = max(entry["start"], v.start), min(entry["end"], v.end)
                if hi > lo:
                    out[v.name][lo - v.start : hi - v.start] = unpack_bits(entry["bits"], lo - entry["start"], hi - entry["start"])
                    covered[v.name] += hi - lo
        for v in views:
            if covered[v.name] != v.local_numel:
                raise ValueError(f"{directory}: the saved masks cover {covered[v.name]} of {v.local_numel} local elements of {v.name}")
        return cls(out, meta)


class MaskEnforcer:
    """Re-zeroes pruned weights; call after every optimizer step (or `install` it).

    The full mask is cached for weights every rank holds in full (replicated, ZeRO-1/2
    working copies, ZeRO-3 persistent parameters) so that enforcing is local: no
    collective per training step.
    """

    def __init__(self, model_or_engine: Any, masks: MaskSet, targets: str = "decoder_linears", comm: Collectives | None = None) -> None:
        self.comm = comm or Collectives()
        self.views = [v for v in build_views(model_or_engine, targets, self.comm) if v.name in masks]
        self.local = {v.name: masks[v.name] for v in self.views}
        self.full: dict[str, torch.Tensor] = {}
        for v in self.views:
            if v.shard.keeps_full_working:
                self.full[v.name] = gather_full(v, self.local[v.name], self.comm)

    @torch.no_grad()
    def __call__(self) -> None:
        for v in self.views:
            local = self.local[v.name]
            v.write(local.to(v.lp().device), 0.0, master=True)  # this rank's range: working copy and fp32 master
            full = v.shard.full_working() if v.name in self.full else None
            if full is not None and full.numel() == v.numel:  # a full working copy is present
                full.view(-1)[self.full[v.name].to(full.device)] = 0

    def install(self, optimizer: torch.optim.Optimizer) -> Any:
        """Run after every `optimizer.step()` of a torch optimizer; returns the hook handle."""
        return optimizer.register_step_post_hook(lambda *_: self())

    def check(self) -> int:
        """Number of masked weights that are not exactly zero in this rank's working copy."""
        bad = 0
        for v in self.views:
            bad += int((v.lp()[self.local[v.name].to(v.lp().device)] != 0).sum())
            master = v.master()
            if master is not None:
                bad += int((master[self.local[v.name].to(master.device)] != 0).sum())
        return bad
