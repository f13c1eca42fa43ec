"""`prune.decision: original` is the original GradProbe's low-memory streaming pruner: the
masks equal a plain single-process re-implementation of that algorithm written here, with
2 forward+backward passes per matrix and fp32 statistics; and the mode's settings are
filled only where the config left them unset."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.config import PruneConfig
from harness.config.prune_modes import resolve_prune
from harness.models import build_model, decoder_blocks
from harness.pruning import recording_g0, run_pruning
from harness.pruning.select import count_for


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 2048, (2, 16), generator=g) for _ in range(3)]


def matrices(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The decoder blocks' Linears in model order (the original walks named_parameters)."""
    inside = {id(m) for b in decoder_blocks(model) for m in b.modules()}
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) in inside]


def grad_max(model: nn.Module, weight: torch.Tensor, batches: list[torch.Tensor]) -> torch.Tensor:
    """max over batches of |dL/dW| of one matrix, in fp32 (the original's use_fp16=False)."""
    out = None
    for b in batches:
        model.zero_grad(set_to_none=True)
        lm_loss(model, b).backward()
        g = weight.grad.detach().abs().float()
        out = g if out is None else torch.maximum(out, g)
    return out


@torch.no_grad()
def global_magnitude_candidates(mats: list[tuple[str, nn.Linear]], sparsity: float) -> dict[str, torch.Tensor]:
    """One threshold over every matrix (torch's global_unstructured with L1Unstructured)."""
    flat = torch.cat([m.weight.detach().abs().reshape(-1) for _, m in mats])
    k = count_for(sparsity, flat.numel())
    ordered = torch.sort(flat).values
    assert ordered[k - 1] < ordered[k], "a tie at the threshold would make the candidate set depend on tie-breaking"
    return {n: m.weight.detach().abs() <= ordered[k - 1] for n, m in mats}


def reference_streaming(
    model: nn.Module, batches: list[torch.Tensor], sparsity: float, reduction: float, threshold: float
) -> dict[str, torch.Tensor]:
    """The original algorithm, straightforwardly: candidates once from the dense model, then per
    matrix G0, shrink, G1, restore, veto, and zero before the next matrix is probed."""
    model.eval()
    mats = matrices(model)
    candidates = global_magnitude_candidates(mats, sparsity)
    masks = {}
    for name, lin in mats:
        w = lin.weight
        g0 = grad_max(model, w, batches)
        dense = w.detach().clone()
        with torch.no_grad():
            w[candidates[name]] *= reduction
        g1 = grad_max(model, w, batches)
        with torch.no_grad():
            w.copy_(dense)
            masks[name] = candidates[name] & (g1 <= g0 * (1.0 + threshold))
            w[masks[name]] = 0.0
    model.zero_grad(set_to_none=True)
    return masks


@pytest.mark.parametrize("threshold", [0.0, 0.05])
def test_original_mode_equals_a_plain_reimplementation(threshold: float) -> None:
    sparsity, reduction = 0.5, 0.1
    model = build_model("tiny-llama")
    reference = build_model("tiny-llama")
    expected = reference_streaming(reference, calib(), sparsity, reduction, threshold)
    cfg = PruneConfig(
        method="gradprobe", base="magnitude", decision="original", sparsity=sparsity, reduction=reduction, threshold=threshold
    )
    with recording_g0() as g0:
        report = run_pruning(model, calib(), cfg, lm_loss)
    mats = matrices(model)
    assert len(mats) == 14  # tiny-llama: 7 Linears x 2 blocks
    assert report.fwd_bwd_passes == 2 * len(mats)  # G0 and G1 per matrix
    # Block 1's 14 passes: the first computes block 0 and keeps its outputs, the other 13 replay
    # them; the first replay is checked against one full forward of one micro-batch.
    assert report.replayed_passes == 2 * 7 - 1 and report.fwd_passes == 1 / len(calib())
    assert report.groups == len(mats) and report.group_size == 1 and not report.exact_target
    assert all(t.dtype == torch.float32 for t in g0.values()) and len(g0) == len(mats)
    for name, lin in mats:
        got = report.masks[name].reshape(lin.weight.shape)
        assert torch.equal(got, expected[name]), (name, int((got != expected[name]).sum()))
        assert torch.equal(lin.weight == 0, expected[name]), name
    # candidates came from one global threshold (not per matrix), and the veto bit
    candidates = global_magnitude_candidates(matrices(build_model("tiny-llama")), sparsity)
    per_matrix = {n: int(c.sum()) for n, c in candidates.items()}
    assert len(set(c / m.weight.numel() for (n, m), c in zip(mats, per_matrix.values()))) > 1
    vetoed = sum(int((candidates[n] & ~expected[n]).sum()) for n, _ in mats)
    assert vetoed > 0 and report.achieved_sparsity < sparsity


def test_original_mode_on_a_wanda_base_chooses_candidates_on_the_dense_model() -> None:
    """A Wanda base picks per row, from input norms of the dense model (the first G0 pass):
    the pruned weights lie within dense Wanda's choice, every row at most at the target."""
    sparsity = 0.5
    model = build_model("tiny-llama")
    report = run_pruning(model, calib(), PruneConfig(method="gradprobe", decision="original", sparsity=sparsity), lm_loss)
    wanda = build_model("tiny-llama")
    run_pruning(wanda, calib(), PruneConfig(method="wanda", sparsity=sparsity, sequential=False), lm_loss)  # on the dense model
    assert report.fwd_bwd_passes == 2 * 14 and report.replayed_passes == 13
    for (name, a), (_, b) in zip(matrices(model), matrices(wanda)):
        assert torch.all((a.weight == 0) <= (b.weight == 0)), name
        assert torch.all((a.weight == 0).sum(1) <= count_for(sparsity, a.weight.shape[1])), name
    assert 0 < report.achieved_sparsity < sparsity


def test_mode_defaults_fill_only_unset_keys() -> None:
    original, filled = resolve_prune(PruneConfig(method="gradprobe", base="magnitude", decision="original"))
    assert (original.scope, original.stat_dtype, original.exact_target, original.sequential, original.group_size) == (
        "global",
        "fp32",
        False,
        True,
        1,
    )
    assert filled == ["scope=global", "stat_dtype=fp32", "exact_target=false", "sequential=true", "group_size=1"]
    explicit, filled = resolve_prune(
        PruneConfig(
            method="gradprobe",
            base="magnitude",
            decision="original",
            scope="global",
            stat_dtype="fp32",
            exact_target=False,
            sequential=True,
            group_size=1,
        )
    )
    assert filled == [] and explicit.stat_dtype == "fp32"
    rank, _ = resolve_prune(PruneConfig(method="gradprobe", decision="veto"))  # the veto's defaults, unchanged
    assert (rank.scope, rank.stat_dtype, rank.exact_target, rank.sequential, rank.group_size) == ("per_matrix", "bf16", True, False, 0)
    assert resolve_prune(PruneConfig(method="sparsegpt"))[0].sequential is True
