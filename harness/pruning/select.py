"""Exact, deterministic selection of the k lowest-scored weights, across ranks.

Why exact and not a histogram estimate: a mask that depends on how the matrix happens to
be cut across ranks makes world-2 results differ from world-1 results and makes
"achieved sparsity == target" false by a rounding error. Here the order is total and
independent of sharding: scores become integer keys (a monotone map of the float bits),
ties are broken by the global flat index (lower index pruned first), and the k-th element
is found by a radix select whose only communication is an all-reduce of 256-bucket
count histograms per 8-bit digit (4-7 rounds per call, batched over all problems).

Selection rules:
- per matrix / global: one problem per matrix, or one over all matrices;
- per row (Wanda): whole local rows are sorted locally; only rows cut by a rank
  boundary become distributed problems (counts travel, never weights);
- N:M: groups of M consecutive inputs in a row; whole local groups are sorted locally,
  groups cut by a boundary become (tiny) distributed problems.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from harness.distributed import Collectives
from harness.pruning.layout import Layout

FLOAT_KEY_BITS = 32  # float_keys() values are < 2**32
DIGIT = 8
NONE_SELECTED = (-1, -1)


def float_keys(scores: torch.Tensor) -> torch.Tensor:
    """Monotone map of float32 scores to int64 keys in [0, 2**32).

    Equal floats give equal keys (-0.0 is folded into +0.0); NaN is an error because it
    has no place in an order and would make masks depend on the kernel that produced it.
    """
    x = scores.detach().to(torch.float32) + 0.0
    if torch.isnan(x).any():
        raise ValueError("pruning scores contain NaN")
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits + (1 << 31), -1 - bits)


def count_for(fraction: float, n: int) -> int:
    """floor(fraction * n), computed on the decimal value the user wrote (0.29*100 is 29)."""
    return math.floor(Fraction(repr(float(fraction))) * n)


def radix_select(
    problems: list[list[tuple[torch.Tensor, torch.Tensor]]],
    ks: list[int],
    comm: Collectives,
    key_bits: int,
    index_bits: int,
) -> list[tuple[int, int]]:
    """For each problem, the (key, index) of its k-th smallest element across all ranks.

    A problem is this rank's list of (keys, global_index) chunks (1-D int64, keys in
    [0, 2**key_bits), indices unique within the problem across ranks). The returned
    threshold t selects exactly k elements via `threshold_mask`. Every rank must pass the
    same number of problems and the same ks, in the same order.
    """
    n = len(problems)
    result: list[tuple[int, int]] = [NONE_SELECTED] * n
    active = [i for i in range(n) if ks[i] > 0]
    if not active or n == 0:
        return result
    remaining = {i: ks[i] for i in active}
    key_prefix = {i: 0 for i in active}
    chunks = {i: [(k.reshape(-1), j.reshape(-1)) for k, j in problems[i]] for i in active}
    device = next((k.device for i in active for k, _ in chunks[i]), torch.device("cpu"))

    def run(field: int, bits: int, prefix: dict[int, int]) -> None:
        top = ((max(bits, 1) - 1) // DIGIT) * DIGIT
        for shift in range(top, -1, -DIGIT):
            hist = torch.zeros(len(active), 1 << DIGIT, dtype=torch.int64, device=device)
            for row, i in enumerate(active):
                for pair in chunks[i]:
                    if pair[field].numel():
                        digits = (pair[field] >> shift) & ((1 << DIGIT) - 1)
                        hist[row] += torch.bincount(digits, minlength=1 << DIGIT)
            hist = comm.all_reduce_sum(hist).cpu()
            for row, i in enumerate(active):
                cum = torch.cumsum(hist[row], 0)
                if int(cum[-1]) < remaining[i]:
                    raise ValueError(f"selection asks for {ks[i]} elements but only {int(cum[-1])} remain")
                digit = int(torch.searchsorted(cum, torch.tensor(remaining[i])))
                below = int(cum[digit - 1]) if digit > 0 else 0
                remaining[i] -= below
                prefix[i] |= digit << shift
                kept = []
                for pair in chunks[i]:
                    keep = ((pair[field] >> shift) & ((1 << DIGIT) - 1)) == digit
                    kept.append((pair[0][keep], pair[1][keep]))
                chunks[i] = kept

    run(0, key_bits, key_prefix)
    index_prefix = {i: 0 for i in active}
    run(1, index_bits, index_prefix)
    for i in active:
        result[i] = (key_prefix[i], index_prefix[i])
    return result


def threshold_mask(keys: torch.Tensor, index: torch.Tensor, threshold: tuple[int, int]) -> torch.Tensor:
    """The elements at or below a `radix_select` threshold in (key, index) order."""
    tk, ti = threshold
    return (keys < tk) | ((keys == tk) & (index <= ti))


def _bits(n: int) -> int:
    return max(1, int(n - 1).bit_length())


def _local_lowest(keys_2d: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of `keys_2d`, mark the k lowest keys; a stable sort breaks ties by position,
    i.e. by global index, exactly as `radix_select` does."""
    mask = torch.zeros_like(keys_2d, dtype=torch.bool)
    if k > 0 and keys_2d.numel():
        order = torch.sort(keys_2d, dim=1, stable=True).indices[:, :k]
        mask.scatter_(1, order, True)
    return mask


def select_per_matrix(
    layouts: list[Layout], keys: list[torch.Tensor], counts: list[int], comm: Collectives, key_bits: int
) -> list[torch.Tensor]:
    """Mark `counts[i]` lowest keys of matrix i (local pieces in, local masks out)."""
    problems = []
    for lay, k in zip(layouts, keys):
        idx = torch.arange(lay.start, lay.end, dtype=torch.int64, device=k.device)
        problems.append([(k, idx)])
    index_bits = _bits(max((lay.numel for lay in layouts), default=1))
    thresholds = radix_select(problems, counts, comm, key_bits, index_bits)
    return [threshold_mask(p[0][0], p[0][1], t) for p, t in zip(problems, thresholds)]


def select_global(layouts: list[Layout], keys: list[torch.Tensor], count: int, comm: Collectives, key_bits: int) -> list[torch.Tensor]:
    """Mark the `count` lowest keys over all matrices together (ties: earlier matrix first)."""
    offsets, total = [], 0
    for lay in layouts:
        offsets.append(total)
        total += lay.numel
    chunks = []
    for lay, k, off in zip(layouts, keys, offsets):
        chunks.append((k, torch.arange(off + lay.start, off + lay.end, dtype=torch.int64, device=k.device)))
    (t,) = radix_select([chunks], [count], comm, key_bits, _bits(total))
    return [threshold_mask(k, i, t) for k, i in chunks]


def select_per_unit(
    layouts: list[Layout], keys: list[torch.Tensor], unit: list[int], per_unit: list[int], comm: Collectives, key_bits: int
) -> list[torch.Tensor]:
    """Mark the `per_unit[i]` lowest keys in every aligned block of `unit[i]` elements.

    Rows are units of `cols` (per-row selection, Wanda); N:M groups are units of M
    (M must divide cols so no group spans two rows). Whole local units are decided by a
    local sort; units cut by a rank boundary become distributed problems whose only
    traffic is count histograms.
    """
    masks = [torch.zeros(lay.local_numel, dtype=torch.bool, device=k.device) for lay, k in zip(layouts, keys)]
    problems, ks, where = [], [], []
    for m, (lay, k, u, per) in enumerate(zip(layouts, keys, unit, per_unit)):
        if lay.cols % u:
            raise ValueError(f"unit {u} does not divide the row length {lay.cols}")
        first, last = lay.whole_units(u)
        if last > first:
            sl = lay.local_slice(first * u, last * u)
            masks[m][sl] = _local_lowest(k[sl].reshape(last - first, u), per).reshape(-1)
        for split in lay.split_units(u):
            sl = lay.local_slice(split * u, (split + 1) * u)
            idx = torch.arange(lay.start + sl.start, lay.start + sl.stop, dtype=torch.int64, device=k.device)
            problems.append([(k[sl], idx)])
            ks.append(per)
            where.append((m, sl))
    if problems:
        index_bits = _bits(max(lay.numel for lay in layouts))
        thresholds = radix_select(problems, ks, comm, key_bits, index_bits)
        for (m, sl), prob, t in zip(where, problems, thresholds):
            if sl.stop > sl.start:
                masks[m][sl] = threshold_mask(prob[0][0], prob[0][1], t)
    return masks


def parse_pattern(pattern: str) -> tuple[int, int] | None:
    """'unstructured' -> None; 'N:M' -> (N kept, M) per group."""
    if pattern == "unstructured":
        return None
    n, m = (int(x) for x in pattern.split(":"))
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern}: N:M needs 0 < N < M")
    return n, m
