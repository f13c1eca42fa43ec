"""Block-by-block pruning (`harness.pruning.blockwise`) on a tiny Gemma 3, whose layers alternate
sliding-window and global attention with different rotary bases (transformers' `layer_types`):
each block replayed on its own captured call gives the model's own hidden states, SparseGPT block
by block equals SparseGPT run through the whole model once per block, and its result does not
depend on the free memory. One process, seconds."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from harness.config import PruneConfig
from harness.distributed import Collectives
from harness.models import decoder_blocks
from harness.pruning import build_views, run_pruning
from harness.pruning.baselines import obs_prune
from harness.pruning.blockwise import capture_block_calls
from harness.pruning.calibration import InputStats, Ledger, Runner, forward_pass
from harness.pruning.methods import make_rule

SEQ = 12  # longer than the sliding window: the two layer types see different masks


def tiny_gemma() -> nn.Module:
    cfg = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Gemma3ForCausalLM(cfg).eval()


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (2, SEQ), generator=g) for _ in range(4)]


def block_outputs(model: nn.Module, batch: torch.Tensor) -> list[torch.Tensor]:
    """Each decoder block's output in the model's own forward."""
    outs: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda _m, _a, o: outs.append(o[0] if isinstance(o, tuple) else o)) for b in decoder_blocks(model)]
    with torch.no_grad():
        model(input_ids=batch, use_cache=False)
    for h in hooks:
        h.remove()
    return outs


def test_each_block_on_its_own_call_gives_the_models_hidden_states() -> None:
    model = tiny_gemma()
    blocks = decoder_blocks(model)
    batches = calib()
    hidden, calls = capture_block_calls(Runner(model, lm_loss), batches, blocks, stop_early=True)
    for b, batch in enumerate(batches):
        want = block_outputs(model, batch)
        h = hidden[b]
        for i, block in enumerate(blocks):
            with torch.no_grad():
                h = calls[i][b](block, h)
            torch.testing.assert_close(h, want[i], rtol=0, atol=0)
        # the model is sensitive to it: block 0's call (a sliding layer's mask and rotary
        # embedding) replayed for the global layer 1 computes another output
        with torch.no_grad():
            wrong = calls[0][b](blocks[1], want[0])
        assert not torch.allclose(wrong, want[1], atol=1e-4)


def whole_model_sparsegpt(model: nn.Module, batches: list[torch.Tensor], cfg: PruneConfig) -> None:
    """The reference: SparseGPT block after block, each block's Hessians from a forward of the whole
    model with the blocks below already pruned (what block-by-block streaming must equal)."""
    comm, ledger = Collectives(), Ledger()
    runner = Runner(model, lm_loss)
    views = build_views(model, cfg.targets, comm)
    rule = make_rule(PruneConfig(method="sparsegpt", sparsity=cfg.sparsity, pattern=cfg.pattern, scope="per_matrix"))
    for u in range(len(decoder_blocks(model))):
        mine = [v for v in views if v.target.unit == u]
        stats = InputStats(mine, hessian=True, ledger=ledger)
        forward_pass(runner, batches, stats)
        stats.finalize(comm)
        obs_prune(mine, stats, rule, None, {}, comm, ledger)


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_sparsegpt_block_by_block_equals_the_whole_model_once_per_block(pattern: str) -> None:
    cfg = PruneConfig(method="sparsegpt", sparsity=0.5, pattern=pattern)
    streamed, reference = tiny_gemma(), tiny_gemma()
    report = run_pruning(streamed, calib(), cfg, lm_loss)
    whole_model_sparsegpt(reference, calib(), cfg)
    for (name, p), q in zip(streamed.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert report.group_size == 1 and report.groups == len(decoder_blocks(streamed))
    # about 3 passes, not one per block: the capture, then each block dense and pruned
    assert report.fwd_passes <= 3


@pytest.mark.parametrize("method", ["sparsegpt", "wanda"])
def test_the_result_does_not_depend_on_the_free_memory(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.pruning.calibration as calibration

    results = []
    for free in (1 << 20, 1 << 50):
        monkeypatch.setattr(calibration, "available_bytes", lambda _device, free=free: free)
        model = tiny_gemma()
        run_pruning(model, calib(), PruneConfig(method=method, sparsity=0.5), lm_loss)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
