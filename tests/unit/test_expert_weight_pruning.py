"""Weight pruning (`prune.method`) of the stacked expert tensors transformers 5 holds a MoE layer's
experts in (`experts.gate_up_proj` [experts, out, in], gpt-oss's [experts, in, out]).

- Each expert's input norms are those of the tokens routed to it, and its down projection's of
  their gated activations: equal to what transformers' eager loop feeds each expert's matrices
  (recorded from its `F.linear` calls, while the statistics are taken on the default grouped_mm
  implementation), for Qwen3-MoE and Mixtral.
- Wanda's masks then equal a hand selection: per row of each expert, the lower half of
  |W| x that expert's input norm; and the export, written in the family's per-expert layout,
  holds every zero (`exported_zeros` reads it through transformers' conversion).
- gpt-oss stores its experts transposed: a per-row rule leaves them whole and says why in the
  report; a per-matrix rule prunes exactly its share of each, biases untouched.

World 2 against world 1 (FSDP2, ZeRO-3: the same masks) is measured by hand in notes/expert_pruning.md.
"""

from __future__ import annotations

import pytest
import torch
from model_families import moe_configs
from transformers import AutoModelForCausalLM

from harness.config import PruneConfig
from harness.distributed import Collectives
from harness.prune import exported_zeros
from harness.pruning import build_views, run_pruning
from harness.pruning.calibration import InputStats


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_configs(4)[family]).eval()
    with torch.no_grad():  # routing that is not uniform: the experts see different tokens
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20.0) if hasattr(layer.mlp, "gate") else layer.mlp.router.weight.mul_(20.0)
    return model


def _batches() -> list[torch.Tensor]:
    return [torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _fed(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """Per stacked tensor, [experts, inputs]: the sum of squares of what transformers' eager loop
    passes each expert's matrix (`F.linear(x, tensor[e])`), over the calibration batches."""
    stacked = {p.untyped_storage().data_ptr(): (name, p) for name, p in model.named_parameters() if p.dim() == 3}
    sums: dict[str, torch.Tensor] = {}
    real = torch.nn.functional.linear

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        found = stacked.get(w.untyped_storage().data_ptr())
        if found is not None:
            name, p = found
            acc = sums.setdefault(name, torch.zeros(p.shape[0], p.shape[-1], dtype=torch.float64))
            acc[w.storage_offset() // p[0].numel()] += x.detach().double().square().reshape(-1, x.shape[-1]).sum(0)
        return real(x, w, b)

    model.set_experts_implementation("eager")
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(torch.nn.functional, "linear", linear)
        for batch in _batches():
            model(input_ids=batch)
    model.set_experts_implementation("grouped_mm")
    assert len(sums) == 2 * len(model.model.layers)
    return sums


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_each_expert_is_scored_by_its_own_inputs_and_the_export_holds_the_zeros(family, monkeypatch, tmp_path) -> None:
    model = _model(family)
    fed = _fed(model, monkeypatch)
    views = [v for v in build_views(model, "decoder_linears", Collectives()) if v.target.experts]
    assert [v.name for v in views] == list(fed)
    with InputStats(views, hessian=False) as stats, torch.no_grad():
        for batch in _batches():
            model(input_ids=batch)
    stats.finalize(Collectives())
    for v in views:
        torch.testing.assert_close(stats.sumsq[v.name].view(v.target.experts, -1), fed[v.name], rtol=1e-6, atol=0.0)

    weights = {v.name: v.param.detach().clone() for v in views}
    report = run_pruning(model, _batches(), PruneConfig(method="wanda", sparsity=0.5, sequential=False), _loss)
    assert report.unpruned_expert_parameters == 0
    params = dict(model.named_parameters())
    for name, w in weights.items():
        score = w.abs() * fed[name].sqrt().unsqueeze(1)  # [experts, out, in]: each row's inputs are its expert's
        kept = score.argsort(dim=-1, stable=True)[..., w.shape[-1] // 2 :]
        expected = torch.ones_like(w, dtype=torch.bool).scatter_(-1, kept, False)
        assert torch.equal(params[name] == 0, expected), name

    model.save_pretrained(tmp_path)  # the family's per-expert files (Mixtral's block_sparse_moe.experts.E.w1 ...)
    pruned = {x.param: x.pruned for x in report.layers}
    zeros = exported_zeros(str(tmp_path), list(pruned))
    assert zeros == {p: int((params[p] == 0).sum()) for p in pruned}
    assert all(zeros[p] >= n > 0 for p, n in pruned.items())


def test_transposed_experts_left_whole_by_a_per_row_rule_and_pruned_per_matrix() -> None:
    model = _model("gpt_oss")
    stacked = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    report = run_pruning(model, _batches(), PruneConfig(method="gradprobe", sparsity=0.5), _loss)
    whole = sum(p.numel() for n, p in stacked.items() if p.dim() == 3)
    assert report.unpruned_expert_parameters == whole
    assert "[experts, in, out]" in report.unpruned_experts_reason and "stacked expert tensors left whole" in report.summary()
    assert all(torch.equal(p, stacked[n]) for n, p in model.named_parameters() if n in stacked)

    report = run_pruning(model, _batches(), PruneConfig(method="gradprobe", base="magnitude", scope="per_matrix", sparsity=0.5), _loss)
    assert report.unpruned_expert_parameters == 0
    for name, p in model.named_parameters():
        if name in stacked:  # exactly half of each 3-D tensor; the biases are no target
            assert int((p == 0).sum()) == (p.numel() // 2 if p.dim() == 3 else int((stacked[name] == 0).sum())), name
