"""`harness.distributed.traffic`: the bytes a rank sends, counted from the collectives it dispatches,
against the volumes worked out by hand (rank 0 of a fake 2-rank group: nothing moves, every call is
seen). The planner's traffic and the measured one are both this count (tests/integration/
test_planner_accuracy.py, test_planner_moe.py compare them); this test is what holds the rule itself."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single, all_to_all_single_autograd, reduce_scatter_single

from harness.distributed import CollectiveBytes
from harness.planner.trace import fake_process_group


def test_each_collective_counts_what_this_rank_sends() -> None:
    f = torch.float32
    with fake_process_group(2), CollectiveBytes() as sent:
        dist.all_gather_into_tensor(torch.empty(20, dtype=f), torch.ones(10, dtype=f))  # its 40 B to the other rank
        dist.reduce_scatter_tensor(torch.empty(10, dtype=f), torch.ones(20, dtype=f))  # half of 80 B
        dist.all_reduce(torch.ones(10, dtype=f))  # 40 B x 2 (W - 1) / W
        dist.all_to_all_single(torch.empty(8, 2), torch.ones(8, 2), [3, 5], [3, 5])  # keeps 3 rows of 8 B, sends 5
        dist.broadcast(torch.ones(4, dtype=f), src=0)  # the root sends 16 B
        dist.barrier()
        x = torch.ones(8, 2, requires_grad=True)
        all_to_all_single_autograd(x * 1, [6, 2], [6, 2], dist.group.WORLD).sum().backward()  # 2 rows each way
        all_gather_single(torch.ones(10), 0, dist.group.WORLD).sum()  # functional (waited on): 40 B
        reduce_scatter_single(torch.ones(20), "sum", 0, dist.group.WORLD).sum()  # functional: 40 B
    assert dict(sent.sent) == {"all_gather": 80, "reduce_scatter": 80, "all_reduce": 40, "all_to_all": 40 + 2 * 16, "broadcast": 16}
    assert sent.calls["all_to_all"] == 3 and sent.total == 80 + 80 + 40 + 72 + 16
