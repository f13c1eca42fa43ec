"""GradProbe's reconstruct mode (`harness.pruning.reconstruct`) on the tiny Llama, one process:
exact target counts and 2:4 validity, pruned weights exactly zero, the block fit lowering the
error it minimises, and a stop request. Seconds each."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.config import PruneConfig
from harness.distributed import Collectives
from harness.errors import StopRequested
from harness.models import build_model, decoder_blocks
from harness.pruning import build_views, run_pruning
from harness.pruning.select import count_for


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 2048, (2, 16), generator=g) for _ in range(3)]


def cfg(**kw) -> PruneConfig:
    return PruneConfig(method="gradprobe", decision="reconstruct", **{"sparsity": 0.5, "recon_steps": 3, "recon_lr": 1e-3, **kw})


@pytest.mark.parametrize("pattern,sparsity", [("unstructured", 0.6), ("2:4", 0.5)])
def test_exact_counts_and_zeros(pattern: str, sparsity: float) -> None:
    model = build_model("tiny-llama")
    report = run_pruning(model, calib(), cfg(pattern=pattern, sparsity=sparsity), lm_loss)
    for v in build_views(model, "decoder_linears", Collectives()):
        mask = report.masks[v.name]
        w = v.weight()
        assert torch.all(w[mask] == 0), v.name  # pruned entries stay exactly zero through the fit
        assert int((w == 0).sum()) == int(mask.sum()), v.name  # and nothing else is zero
        if pattern == "2:4":
            assert torch.all(mask.reshape(-1, 4).sum(1) == 2), v.name
        else:
            # SparseGPT's rule: the count of every block of 128 columns, over all rows
            blocks = [min(128, v.cols - i) for i in range(0, v.cols, 128)]
            assert int(mask.sum()) == sum(count_for(sparsity, v.rows * w) for w in blocks), v.name
    assert report.group_size == 1 and report.groups == len(decoder_blocks(model))
    assert report.fwd_bwd_passes > 0


def _block_error(steps: int) -> float:
    """The error the fit minimises, ||block(X) - dense block(X)||^2 summed over the blocks,
    each on the pruned blocks' outputs, after pruning with `steps` epochs of the fit."""
    dense, model = build_model("tiny-llama"), build_model("tiny-llama")
    run_pruning(model, calib(), cfg(recon_steps=steps), lm_loss)
    err = 0.0
    for batch in calib():
        seen: list[torch.Tensor] = []
        hooks = [b.register_forward_pre_hook(lambda _m, a: seen.append(a[0])) for b in decoder_blocks(model)]
        with torch.no_grad():
            model(input_ids=batch, use_cache=False)
        for h in hooks:
            h.remove()
        outs: list[torch.Tensor] = []
        hooks = [b.register_forward_hook(lambda _m, _a, o: outs.append(o[0] if isinstance(o, tuple) else o)) for b in decoder_blocks(model)]
        with torch.no_grad():
            model(input_ids=batch, use_cache=False)
        for h in hooks:
            h.remove()
        for i, (d, b) in enumerate(zip(decoder_blocks(dense), decoder_blocks(model))):
            kw_capture: dict = {}
            h = b.register_forward_pre_hook(lambda _m, a, k: kw_capture.update(k), with_kwargs=True)
            with torch.no_grad():
                model(input_ids=batch, use_cache=False)
            h.remove()
            with torch.no_grad():
                y = d(seen[i], **kw_capture)
            y = y[0] if isinstance(y, tuple) else y
            err += float((outs[i] - y).pow(2).sum())
    return err


def test_the_block_fit_lowers_the_error_it_minimises() -> None:
    assert _block_error(steps=5) < 0.9 * _block_error(steps=0)


def test_a_stop_request_ends_the_stage() -> None:
    asked: list[int] = []

    def should_stop() -> bool:
        asked.append(0)
        return len(asked) > 5

    with pytest.raises(StopRequested, match="the pruning was not finished"):
        run_pruning(build_model("tiny-llama"), calib(), cfg(), lm_loss, should_stop=should_stop)
    assert len(asked) == 6


@pytest.mark.parametrize("bad", [{"scope": "global"}, {"sequential": False}, {"recon_lr": 0.0}, {"recon_steps": -1}])
def test_settings_the_mode_cannot_honour_are_refused(bad: dict) -> None:
    from harness.config.prune_modes import check_prune_mode
    from harness.errors import ConfigError

    with pytest.raises(ConfigError, match="prune.decision=reconstruct"):
        check_prune_mode(cfg(**bad))


def test_run_pruning_refuses_a_key_only_the_other_decisions_read_before_any_pass() -> None:
    """A library caller's `PruneConfig(method="gradprobe", pool=0.0)` meant the veto when the veto was
    the default: refused before the model is touched, not pruned by reconstruct ignoring `pool`."""
    from harness.errors import ConfigError

    model = build_model("tiny-llama")
    dense = [p.detach().clone() for p in model.parameters()]
    calls: list[int] = []

    def counting_loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        calls.append(0)
        return lm_loss(m, batch)

    with pytest.raises(
        ConfigError, match=r"prune.pool=0.0 is read by prune.decision=veto/rank/saliency/original only; .*unset prune.pool$"
    ):
        run_pruning(model, calib(), PruneConfig(method="gradprobe", sparsity=0.5, pool=0.0), counting_loss)
    assert calls == [] and all(torch.equal(p, q) for p, q in zip(model.parameters(), dense))
