"""Where each rank's piece of a weight matrix sits, and which rows/groups cross ranks.

Every strategy is reduced to one picture: rank r holds the contiguous range
[start_r, end_r) of the row-major flattened global weight (FSDP2 holds whole rows;
ZeRO-3 and ZeRO-1/2 cut anywhere, so a row or an N:M group may be split between ranks,
and a rank's piece may be shorter than one row). Selection rules that need whole rows or
whole groups use this module to find the pieces that are split, so that only those pay
for communication and the rest is decided locally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.distributed import Collectives


class FlatRange:
    """The sizes of a ``rows`` x ``cols`` matrix, row-major flattened, of which this rank holds
    [``start``, ``end``): one definition for `Layout` (its fields) and `harness.pruning.shards.ShardView`
    (its engine shard's)."""

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def local_numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Layout(FlatRange):
    """One matrix's shape and every rank's flat range; `start, end` are this rank's."""

    rows: int
    cols: int
    start: int
    end: int
    ranges: tuple[tuple[int, int], ...]  # (start, end) of every rank, in rank order

    def __post_init__(self) -> None:
        pieces = sorted((a, b) for a, b in self.ranges if b > a)
        cursor = 0
        for a, b in pieces:
            if a != cursor:
                raise ValueError(f"ranges {self.ranges} do not tile [0, {self.numel}) contiguously")
            cursor = b
        if cursor != self.numel:
            raise ValueError(f"ranges {self.ranges} cover [0, {cursor}), not [0, {self.numel})")
        if (self.start, self.end) not in self.ranges and self.end > self.start:
            raise ValueError("this rank's range is not among the ranges")

    def boundaries(self) -> list[int]:
        """Flat positions where one rank's piece ends and another's begins (excluding 0 and numel)."""
        return sorted({a for a, b in self.ranges if b > a and a > 0})

    def split_units(self, unit: int) -> list[int]:
        """Indices of the `unit`-sized aligned blocks (rows: unit=cols; N:M groups: unit=M)
        that are cut by a rank boundary, in increasing order. Identical on every rank."""
        return sorted({b // unit for b in self.boundaries() if b % unit})

    def whole_units(self, unit: int) -> tuple[int, int]:
        """[first, last) indices of the aligned blocks lying entirely in this rank's range."""
        first = -(-self.start // unit)
        last = self.end // unit
        return first, max(first, last)

    def local_slice(self, a: int, b: int) -> slice:
        """The local positions of global flat range [a, b) clipped to this rank's range."""
        lo, hi = max(a, self.start), min(b, self.end)
        if hi <= lo:
            return slice(0, 0)
        return slice(lo - self.start, hi - self.start)

    def owner_of(self, position: int) -> int:
        """The rank whose range contains flat `position`."""
        for rank, (a, b) in enumerate(self.ranges):
            if a <= position < b:
                return rank
        raise IndexError(position)


def even_ranges(numel: int, world: int) -> tuple[tuple[int, int], ...]:
    """ZeRO-style split: ceil(numel/world) elements per rank, the last ranks short or empty.

    Used to share the scoring of replicated weights (DDP, world 1) so that each rank
    scores 1/world of every matrix, as it would under ZeRO-3.
    """
    per = -(-numel // world)
    return tuple((min(r * per, numel), min((r + 1) * per, numel)) for r in range(world))


def gather_ranges(local: list[tuple[int, int]], comm: Collectives) -> list[tuple[tuple[int, int], ...]]:
    """Every rank's (start, end) for each of `local`'s matrices, with one all_gather."""
    t = torch.tensor([x for pair in local for x in pair], dtype=torch.int64).reshape(-1)
    everyone = comm.all_gather(t)
    out = []
    for i in range(len(local)):
        out.append(tuple((int(g[2 * i]), int(g[2 * i + 1])) for g in everyone))
    return out


def exchange_split_units(layout: Layout, local: torch.Tensor, unit: int, comm: Collectives) -> dict[int, torch.Tensor]:
    """Reassemble every split row/group (see `split_units`) on every rank.

    Each rank contributes only its fragments of split units (at most two per rank), so
    the traffic is O(world x unit) regardless of the matrix size: whole weights are
    never gathered. Returns {unit index: full 1-D tensor of length `unit`}.
    """
    split = layout.split_units(unit)
    if not split:
        return {}
    # Each rank's contribution: its fragments of split units, concatenated in unit order.
    lengths = []
    for a, b in layout.ranges:
        n = 0
        for u in split:
            n += max(0, min(b, (u + 1) * unit) - max(a, u * unit))
        lengths.append(n)
    mine = [local[layout.local_slice(u * unit, (u + 1) * unit)] for u in split]
    payload = torch.cat(mine) if mine else local.new_zeros(0)
    pieces = comm.all_gather_varlen(payload, lengths)
    out = {u: local.new_zeros(unit) for u in split}
    for (a, b), piece in zip(layout.ranges, pieces):
        cursor = 0
        for u in split:
            lo, hi = max(a, u * unit), min(b, (u + 1) * unit)
            if hi > lo:
                out[u][lo - u * unit : hi - u * unit] = piece[cursor : cursor + hi - lo]
                cursor += hi - lo
    return out
