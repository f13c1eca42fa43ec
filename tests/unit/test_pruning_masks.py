"""Masks persist: through optimizer steps (with a control showing they would regrow), through
save/load, through an iterative schedule's exact rollback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.config import PruneConfig
from harness.distributed import Collectives
from harness.models import build_model, decoder_blocks
from harness.pruning import MaskEnforcer, MaskSet, build_views, run_pruning, run_schedule
from harness.pruning.masks import pack_bits, unpack_bits


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def batches(seed: int, n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2048, (2, 16), generator=g) for _ in range(n)]


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for b in decoder_blocks(model) for m in b.modules() if isinstance(m, nn.Linear)]


def train(model: nn.Module, steps: int, enforcer: MaskEnforcer | None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if enforcer is not None:
        enforcer.install(opt)
    for batch in batches(11, steps):
        opt.zero_grad()
        lm_loss(model, batch).backward()
        opt.step()


def pruned_model() -> tuple[nn.Module, MaskSet]:
    model = build_model("tiny-llama")
    report = run_pruning(model, batches(1), PruneConfig(method="gradprobe", decision="veto", sparsity=0.5, group_size=0), lm_loss)
    return model, report.masks


def test_pack_unpack_roundtrip_at_any_offset() -> None:
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(53, generator=g) > 0.5
    packed = pack_bits(mask)
    assert packed.numel() == 7
    for lo, hi in [(0, 53), (3, 20), (8, 16), (13, 14), (52, 53)]:
        assert torch.equal(unpack_bits(packed, lo, hi), mask[lo:hi])


def test_masks_survive_optimizer_steps_and_would_regrow_without_enforcement() -> None:
    model, masks = pruned_model()
    before = [lin.weight.detach().clone() for lin in linears(model)]
    enforcer = MaskEnforcer(model, masks)
    train(model, steps=3, enforcer=enforcer)
    assert enforcer.check() == 0
    for lin, old in zip(linears(model), before):
        zero = old == 0
        assert torch.all(lin.weight[zero] == 0)
        assert not torch.equal(lin.weight[~zero], old[~zero])  # training did move the kept weights

    control, _ = pruned_model()
    train(control, steps=3, enforcer=None)
    regrown = sum(int(((lin.weight != 0) & (old == 0)).sum()) for lin, old in zip(linears(control), before))
    assert regrown > 0


def test_save_load_roundtrip_reapplies_the_same_zeros(tmp_path) -> None:
    model, masks = pruned_model()
    comm = Collectives()
    views = build_views(model, "decoder_linears", comm)
    masks.save(str(tmp_path), views, comm)
    fresh = build_model("tiny-llama")
    fresh_views = build_views(fresh, "decoder_linears", comm)
    loaded = MaskSet.load(str(tmp_path), fresh_views, comm)
    assert loaded.meta["method"] == "gradprobe"
    for v in views:
        assert torch.equal(loaded[v.name], masks[v.name])
    loaded.apply(fresh_views, comm)
    for a, b in zip(linears(model), linears(fresh)):
        assert torch.equal(a.weight == 0, b.weight == 0)


def test_load_refuses_a_different_shape(tmp_path) -> None:
    model, masks = pruned_model()
    comm = Collectives()
    masks.save(str(tmp_path), build_views(model, "decoder_linears", comm), comm)
    other = build_model("tiny-llama", config_overrides={"intermediate_size": 172})
    with pytest.raises(ValueError, match="model has"):
        MaskSet.load(str(tmp_path), build_views(other, "decoder_linears", comm), comm)


def test_schedule_stops_at_the_limit_and_rolls_back_exactly() -> None:
    model = build_model("tiny-llama")
    total = sum(lin.weight.numel() for lin in linears(model))
    states: list[list[torch.Tensor]] = []

    def metric(m: nn.Module) -> float:
        # a metric we control: 1 + fraction of pruned target weights; the limit below
        # admits rounds up to 50% sparsity
        states.append([lin.weight.detach().clone() for lin in linears(m)])
        return 1.0 + sum(int((lin.weight == 0).sum()) for lin in linears(m)) / total

    cfg = PruneConfig(method="gradprobe", base="magnitude", decision="veto", group_size=0)
    report = run_schedule(model, batches(2), cfg, lm_loss, metric, targets=[0.2, 0.4, 0.6, 0.8], max_increase=0.5)
    assert [round(r[0], 2) for r in report.rounds] == [0.2, 0.4, 0.6]
    assert report.stopped_at == 0.6
    assert report.accepted is not None and report.accepted.achieved_sparsity == pytest.approx(0.4, abs=1e-3)
    after_accepted = states[2]  # baseline, round 0.2, round 0.4, round 0.6
    for lin, want in zip(linears(model), after_accepted):
        assert torch.equal(lin.weight.detach(), want)
    # rounds are nested: what 0.2 pruned stays pruned at 0.4
    for a, b in zip(states[1], states[2]):
        assert torch.all((a == 0) <= (b == 0))
