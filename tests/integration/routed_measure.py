"""torchrun entry for the planner's expert-parallel test: `harness.planner.measure`'s judge, with
Qwen3-MoE's router choosing where every token goes, one routing case after the other.

- `worst`: every token to experts 0..top_k-1, all on rank 0 of a 2-way split of 4 experts (rank 0
  computes both ranks' rows, rank 1 none);
- `balanced`: token t's k-th choice is expert (t * top_k + k) % experts: every expert, so every rank,
  gets the same rows.

The router's probabilities (its loss) are kept; only the chosen indices are replaced, by a new tensor
(topk saved its own for backward). Usage: `torchrun --nproc_per_node 2 routed_measure.py OUT OVERRIDE... [:: OVERRIDE...]`
(each `::`-separated list one config, measured in the same ranks one after the other); rank 0 writes, per
config, `{case: [each rank's measure_config result]}` to OUT, as a list.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
from transformers.models.qwen3_moe import modeling_qwen3_moe

from harness.distributed import exit_process, teardown
from harness.planner.measure import measure_config

CASES = ("worst", "balanced")
ROUTER = modeling_qwen3_moe.Qwen3MoeTopKRouter
CHOOSE = ROUTER.forward


def routed(case: str):
    def forward(self, hidden_states):
        logits, scores, chosen = CHOOSE(self, hidden_states)
        tokens, k = chosen.shape
        if case == "worst":
            return logits, scores, torch.arange(k).expand(tokens, k).contiguous()
        return logits, scores, (torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :]) % self.num_experts

    return forward


def main() -> None:
    out, words = sys.argv[1], " ".join(sys.argv[2:])
    results = []
    for overrides in (group.split() for group in words.split("::")):
        per_case = {}
        for case in CASES:
            ROUTER.forward = routed(case)
            mine = measure_config(overrides, steps=2, trainer_view=False)
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            per_case[case] = gathered
        results.append(per_case)
    teardown()
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    exit_process(0)


if __name__ == "__main__":
    main()
