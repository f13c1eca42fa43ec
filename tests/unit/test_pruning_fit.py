"""`prune.method=sparsegpt_fit` (`harness.pruning.fit`) on the tiny Llama, one process: exact
target counts and 2:4 validity, pruned weights exactly zero, the block fit lowering the error it
minimises, the guard keeping SparseGPT's weights when a fit diverges, and a stop request. Seconds each."""

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
    return PruneConfig(method="sparsegpt_fit", **{"sparsity": 0.5, "fit_epochs": 3, "fit_lr": 1e-3, **kw})


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
    run_pruning(model, calib(), cfg(fit_epochs=steps), lm_loss)
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


@pytest.mark.parametrize("bad", [{"scope": "global"}, {"sequential": False}, {"fit_lr": 0.0}, {"fit_epochs": -1}])
def test_settings_the_method_cannot_honour_are_refused(bad: dict) -> None:
    from harness.config.prune_modes import check_prune_mode
    from harness.errors import ConfigError

    with pytest.raises(ConfigError, match="prune.method=sparsegpt_fit prunes one decoder block after another"):
        check_prune_mode(cfg(**bad))


def test_run_pruning_refuses_a_key_the_method_does_not_read_before_any_pass() -> None:
    """A library caller's `PruneConfig(method="sparsegpt_fit", pool=0.0)` sets a key only GradProbe
    reads: refused before the model is touched, not pruned with `pool` ignored."""
    from harness.errors import ConfigError

    model = build_model("tiny-llama")
    dense = [p.detach().clone() for p in model.parameters()]
    calls: list[int] = []

    def counting_loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        calls.append(0)
        return lm_loss(m, batch)

    with pytest.raises(
        ConfigError, match=r"prune.pool=0.0 is read by prune.method=gradprobe only, not prune.method=sparsegpt_fit: .*unset prune.pool$"
    ):
        run_pruning(model, calib(), cfg(pool=0.0), counting_loss)
    assert calls == [] and all(torch.equal(p, q) for p, q in zip(model.parameters(), dense))


def test_a_divergent_fit_keeps_sparsegpts_weights() -> None:
    """A step size far too large for the model (planted: 10, retried at 1) makes every block's
    held-out error worse than SparseGPT's: the guard undoes each fit, so the pruned model is
    SparseGPT's to the bit, and the report says so per block."""
    fitted, plain = build_model("tiny-llama"), build_model("tiny-llama")
    report = run_pruning(fitted, calib6(), cfg(fit_lr=10.0, fit_epochs=1), lm_loss)
    run_pruning(plain, calib6(), PruneConfig(method="sparsegpt", sparsity=0.5), lm_loss)
    fits = report.details["fit"]
    assert [f["kept"] for f in fits] == ["sparsegpt"] * len(decoder_blocks(fitted))
    assert all(f["held_out"] and f["error_fit"] > f["error_sparsegpt"] or f["error_fit"] != f["error_fit"] for f in fits)
    assert all(torch.equal(p, q) for p, q in zip(fitted.parameters(), plain.parameters()))
    # a sane step size is kept where it helps: the guard is not a refusal of every fit
    kept = run_pruning(build_model("tiny-llama"), calib6(), cfg(fit_epochs=3), lm_loss).details["fit"]
    assert any(f["kept"] == "fit" and f["error_fit"] < f["error_sparsegpt"] for f in kept)


def calib6() -> list[torch.Tensor]:
    """Six micro-batches: five fit steps and one held out for the guard."""
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 2048, (2, 16), generator=g) for _ in range(6)]


def test_old_names_of_the_fit_are_refused_with_the_new_ones() -> None:
    from harness.config import load_config
    from harness.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^prune.decision=reconstruct is now prune.method=sparsegpt_fit"):
        load_config(None, ["prune.method=gradprobe", "prune.decision=reconstruct"])
    with pytest.raises(ConfigError, match=r"^config key 'prune.recon_steps' is now prune.fit_epochs"):
        load_config(None, ["prune.method=sparsegpt_fit", "prune.recon_steps=2"])
