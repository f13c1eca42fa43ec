"""Activation checkpointing: numerically neutral, and it cuts the activation bytes held for backward."""

from __future__ import annotations

import pytest
import torch

from harness.memory import StepMemoryTracker, apply_activation_checkpointing, blocks_to_wrap, checkpointed_blocks, clean_fqn
from harness.models import build_model
from harness.training import causal_lm_loss

LAYERS = 4


def _model(ac: str = "none", every: int = 2) -> torch.nn.Module:
    model = build_model("tiny-llama", seed=0, config_overrides={"num_hidden_layers": LAYERS})
    apply_activation_checkpointing(model, ac, every)
    return model


def _batch() -> torch.Tensor:
    return torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(0))


def _train(model: torch.nn.Module, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, first_grads = [], []
    for step in range(steps):
        loss = causal_lm_loss(model, _batch())
        loss.backward()
        if step == 0:
            first_grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first_grads


def test_blocks_to_wrap() -> None:
    assert blocks_to_wrap(4, "none") == []
    assert blocks_to_wrap(4, "full") == [0, 1, 2, 3]
    assert blocks_to_wrap(4, "op") == [0, 1, 2, 3]
    assert blocks_to_wrap(4, "selective", 2) == [1, 3]
    assert blocks_to_wrap(5, "selective", 3) == [2]
    assert blocks_to_wrap(3, "selective", 1) == [0, 1, 2]
    with pytest.raises(ValueError, match="not one of"):
        blocks_to_wrap(4, "sometimes")
    with pytest.raises(ValueError, match="ac_every"):
        blocks_to_wrap(4, "selective", 0)


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_ac_gives_baseline_losses_and_grads(mode: str) -> None:
    base_losses, base_grads = _train(_model())
    model = _model(mode)
    assert checkpointed_blocks(model) == blocks_to_wrap(LAYERS, mode, 2)
    losses, grads = _train(model)
    assert losses == pytest.approx(base_losses, rel=1e-6)
    assert base_losses[-1] < base_losses[0]
    for g, b in zip(grads, base_grads):
        torch.testing.assert_close(g, b, rtol=1e-5, atol=1e-7)


def test_ac_keeps_state_dict_keys_and_disables_kv_cache() -> None:
    plain, wrapped = _model(), _model("full")
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [clean_fqn(n) for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert wrapped.config.use_cache is False
    wrapped.load_state_dict(plain.state_dict())  # checkpoints move between AC and no AC
    with pytest.raises(ValueError, match="already applied"):
        apply_activation_checkpointing(wrapped, "full")


def _held_after_forward(model: torch.nn.Module) -> tuple[int, int]:
    """(activation bytes held for backward right after forward, activation maximum of the step)."""
    tracker = StepMemoryTracker(model, None)
    with tracker.step():
        loss = causal_lm_loss(model, _batch())
        held = tracker.current()["activations"]
        loss.backward()
    return held, tracker.last_category_maxima()["activations"]


def test_ac_cuts_activation_bytes() -> None:
    held = {mode: _held_after_forward(_model(mode)) for mode in ("none", "selective", "op", "full")}
    none, selective, op, full = (held[m][0] for m in ("none", "selective", "op", "full"))
    # Full AC keeps only block inputs; selective (every 2nd of 4 blocks) sits between.
    assert full < selective < none
    # The op policy keeps matmul/attention outputs but recomputes norms, activations, rotary.
    assert full < op < none
    # Roughly half the blocks checkpointed saves roughly half of full AC's saving.
    assert (none - selective) == pytest.approx((none - full) / 2, rel=0.05)
    # Peaks over the whole step (recomputation included) also drop.
    assert held["full"][1] < held["none"][1]
