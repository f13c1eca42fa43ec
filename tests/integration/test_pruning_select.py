"""Selection rules: exact k, tie-breaking, and identical results when rows, N:M groups and
SparseGPT rows are cut across two ranks at awkward places (mid-row, mid-group, a rank
holding less than one row, a rank holding nothing)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from launching import launch, run_rank

from harness.distributed import Collectives
from harness.pruning.layout import Layout, exchange_split_units
from harness.pruning.methods import Rule, select, sparsegpt_prune
from harness.pruning.select import FLOAT_KEY_BITS, count_for, float_keys, radix_select, threshold_mask

# (rows, cols, ranges of 2 ranks): boundaries inside a row and inside a group of 4, a rank
# with less than one row, an empty rank, and an aligned split.
CASES = {
    "midrow": (5, 8, ((0, 13), (13, 40))),
    "short": (3, 12, ((0, 7), (7, 36))),
    "empty": (4, 4, ((0, 0), (0, 16))),
    "aligned": (2, 16, ((0, 16), (16, 32))),
}
RULES = {
    "per_matrix": Rule("per_matrix", 0.5),
    "per_row": Rule("per_row", 0.6),
    "nm": Rule("nm", 0.5, 2, 4),
}


def case_scores(name: str) -> torch.Tensor:
    rows, cols, _ = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randint(0, 4, (rows * cols,), generator=g).float()  # few values: many ties


def case_hessian(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols, _ = CASES[name]
    g = torch.Generator().manual_seed(7 + sum(map(ord, name)))
    x = torch.randn(4 * cols, cols, generator=g, dtype=torch.float64)
    return torch.randn(rows * cols, generator=g), x.T @ x


def local_layout(name: str, rank: int) -> Layout:
    rows, cols, ranges = CASES[name]
    a, b = ranges[rank]
    return Layout(rows, cols, a, b, ranges)


def whole_layout(name: str) -> Layout:
    rows, cols, _ = CASES[name]
    return Layout(rows, cols, 0, rows * cols, ((0, rows * cols),))


def run_all(layouts: dict[str, Layout], comm: Collectives) -> dict[str, torch.Tensor]:
    """Every rule on every case, plus global selection over all cases and SparseGPT; the
    local piece of each result."""
    out: dict[str, torch.Tensor] = {}
    names = list(CASES)
    for rule_name, rule in RULES.items():
        for name in names:
            lay = layouts[name]
            keys = float_keys(case_scores(name)[lay.start : lay.end])
            (mask,) = select(rule, [lay], [keys], comm, FLOAT_KEY_BITS)
            out[f"{rule_name}/{name}"] = mask
    keys = [float_keys(case_scores(n)[layouts[n].start : layouts[n].end]) for n in names]
    for name, mask in zip(names, select(Rule("global", 0.37), [layouts[n] for n in names], keys, comm, FLOAT_KEY_BITS)):
        out[f"global/{name}"] = mask
    for name in names:
        lay = layouts[name]
        w, H = case_hessian(name)
        for rule in (Rule("per_matrix", 0.5), Rule("nm", 0.5, 2, 4)):
            values, mask = sparsegpt_prune(lay, w[lay.start : lay.end], H, rule, comm, blocksize=8)
            out[f"sparsegpt_{rule.kind}/{name}/values"] = values
            out[f"sparsegpt_{rule.kind}/{name}"] = mask
        rows = exchange_split_units(lay, w[lay.start : lay.end], lay.cols, comm)
        for r, row in rows.items():
            out[f"rows/{name}/{r}"] = row
    return out


def test_float_keys_are_monotone_and_fold_zero() -> None:
    x = torch.tensor([-float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 2.5, float("inf")])
    k = float_keys(x)
    assert torch.all(k[1:] >= k[:-1])
    assert k[3] == k[4]  # -0.0 == +0.0
    assert torch.all((k >= 0) & (k < 2**32))
    with pytest.raises(ValueError):
        float_keys(torch.tensor([float("nan")]))


def test_count_for_uses_the_decimal_value() -> None:
    assert count_for(0.29, 100) == 29
    assert count_for(0.5, 11) == 5
    assert count_for(0.7, 10) == 7


def test_radix_select_matches_a_lexicographic_sort() -> None:
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 50, (3000,), generator=g).to(torch.int64) * 1_000_003  # ties, spread bits
    idx = torch.randperm(3000, generator=g).to(torch.int64)
    comm = Collectives()
    for k in (0, 1, 7, 1500, 2999, 3000):
        chunks = [(keys[:1000], idx[:1000]), (keys[1000:], idx[1000:])]
        (t,) = radix_select([chunks], [k], comm, key_bits=40, index_bits=12)
        mask = threshold_mask(keys, idx, t)
        expected = sorted(range(3000), key=lambda i: (int(keys[i]), int(idx[i])))[:k]
        want = torch.zeros(3000, dtype=torch.bool)
        want[expected] = True
        assert torch.equal(mask, want), k


def test_rules_on_one_rank_select_exact_counts_with_index_tiebreak() -> None:
    comm = Collectives()
    layouts = {n: whole_layout(n) for n in CASES}
    out = run_all(layouts, comm)
    for name, (rows, cols, _) in CASES.items():
        scores = case_scores(name)
        order = sorted(range(rows * cols), key=lambda i: (float(scores[i]), i))
        want = torch.zeros(rows * cols, dtype=torch.bool)
        want[order[: count_for(0.5, rows * cols)]] = True
        assert torch.equal(out[f"per_matrix/{name}"], want)
        per_row = out[f"per_row/{name}"].reshape(rows, cols)
        for r in range(rows):
            row_order = sorted(range(cols), key=lambda c: (float(scores[r * cols + c]), c))
            assert set(per_row[r].nonzero().flatten().tolist()) == set(row_order[: count_for(0.6, cols)])
        groups = out[f"nm/{name}"].reshape(-1, 4)
        assert torch.all(groups.sum(1) == 2)  # exactly 2 pruned (2 kept) in every group of 4
        for gi, grp in enumerate(groups):
            vals = scores[gi * 4 : gi * 4 + 4]
            g_order = sorted(range(4), key=lambda c: (float(vals[c]), c))
            assert set(grp.nonzero().flatten().tolist()) == set(g_order[:2])
    total = sum(r * c for r, c, _ in CASES.values())
    assert sum(int(out[f"global/{n}"].sum()) for n in CASES) == count_for(0.37, total)


def test_two_ranks_with_split_rows_and_groups_equal_one_rank(tmp_path) -> None:

    launch(__file__, [str(tmp_path)], world=2, timeout=120)
    single = run_all({n: whole_layout(n) for n in CASES}, Collectives())
    pieces = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key, want in single.items():
        if key.startswith("rows/"):
            continue
        name = key.split("/")[1]
        _, _, ranges = CASES[name]
        got = torch.cat([pieces[r][key] for r in range(2)])
        assert got.shape == want.shape, key
        if key.endswith("/values"):
            # fp64 arithmetic; rows computed in different batches may differ in the last bits
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=key)
        else:
            assert torch.equal(got, want), key
    # the rows cut by a boundary were reassembled exactly on both ranks
    for name in CASES:
        w, _ = case_hessian(name)
        cols = CASES[name][1]
        keys = [k for k in pieces[0] if k.startswith(f"rows/{name}/")]
        assert keys == [k for k in pieces[1] if k.startswith(f"rows/{name}/")]
        for k in keys:
            r = int(k.rsplit("/", 1)[1])
            assert torch.equal(pieces[0][k], w[r * cols : (r + 1) * cols])
            assert torch.equal(pieces[1][k], w[r * cols : (r + 1) * cols])
    assert any(k.startswith("rows/midrow/") for k in pieces[0]) and any(k.startswith("rows/short/") for k in pieces[0])


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    comm = Collectives()
    out = run_all({n: local_layout(n, comm.rank) for n in CASES}, comm)
    torch.save(out, os.path.join(out_dir, f"rank{comm.rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(_worker, sys.argv[1])
