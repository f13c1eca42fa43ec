"""Optimizer-in-backward (single process): same training, lower gradient peak, checkpoints, rejections.

FSDP2 with two ranks is in test_memory_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim.lr_scheduler import LambdaLR

from harness.config import RunConfig
from harness.config.checks import check_optimizer_in_backward
from harness.errors import ConfigError
from harness.memory import OptimizerInBackward, StepMemoryTracker
from harness.models import build_model
from harness.training import causal_lm_loss

STEPS = 4


def _batch(micro: int) -> torch.Tensor:
    return torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(micro))


def _make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _decay(step: int) -> float:
    return 1.0 / (step + 1)


def _train(
    oib: bool, accum: int, model: torch.nn.Module | None = None, steps: int = STEPS, start: dict | None = None
) -> tuple[list[float], list[float], torch.nn.Module, object, list[float]]:
    model = model or build_model("tiny-llama", seed=0)
    if oib:
        opt = OptimizerInBackward(model, _make)
        sched = opt.make_schedulers(lambda o: LambdaLR(o, _decay))
    else:
        opt = _make(list(model.parameters()))
        sched = LambdaLR(opt, _decay)
    if start is not None:
        opt.load_state_dict(start["opt"])
        sched.load_state_dict(start["sched"])
    losses, lrs, norms = [], [], []
    for _ in range(steps):
        total = 0.0
        for micro in range(accum):
            loss = causal_lm_loss(model, _batch(micro)) / accum
            if oib:
                with opt.micro_batch(last=micro == accum - 1):
                    loss.backward()
                assert opt.steps_in_last_backward == (len(opt.optimizers) if micro == accum - 1 else 0)
            else:
                loss.backward()
            total += loss.item()
        if oib:
            norms.append(opt.last_grad_norm())
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(total)
        lrs.append(sched.get_last_lr()[0])
    return losses, lrs, model, (opt, sched), norms


@pytest.mark.parametrize("accum", [1, 2])
def test_same_losses_as_normal_optimizer(accum: int) -> None:
    ref_losses, ref_lrs, ref_model, _, ref_norms = _train(False, accum)
    losses, lrs, model, _, norms = _train(True, accum)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)  # the norm of the gradients the steps used
    assert ref_losses[-1] < ref_losses[0]
    assert lrs == ref_lrs and len(set(lrs)) == STEPS  # the schedule moved every step
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    assert all(p.grad is None for p in model.parameters())  # every gradient freed in backward


def test_set_lr_reaches_every_parameter() -> None:
    opt = OptimizerInBackward(build_model("tiny-llama", seed=0), _make)
    opt.set_lr(0.123)
    assert {g["lr"] for g in opt.param_groups} == {0.123}
    assert len(opt.param_groups) == len(opt.optimizers)


def test_built_from_the_run_config_follows_the_run_schedule() -> None:
    """OptimizerInBackward(model, cfg.optim, steps): harness.training's optimizer and schedule per parameter."""
    from harness.training import build_optimizer, build_scheduler

    cfg = RunConfig().optim
    model = build_model("tiny-llama", seed=0)
    oib = OptimizerInBackward(model, cfg, total_steps=10)
    ref = build_scheduler(build_optimizer(build_model("tiny-llama", seed=0).parameters(), cfg), cfg, 10)
    for _ in range(3):
        oib.set_last_micro_batch(True)
        causal_lm_loss(model, _batch(0)).backward()
        assert oib.steps_in_last_backward == len(oib.optimizers)
        oib.scheduler.step()
        ref.step()
        assert oib.scheduler.get_last_lr() == ref.get_last_lr()
        assert {g["lr"] for g in oib.param_groups} == set(ref.get_last_lr())


def test_checkpoint_round_trip_and_format() -> None:
    """Resuming from state_dict() continues exactly; the format is the plain optimizer's (FQN-keyed)."""
    full = _train(True, 1, steps=4)[0]
    first, _, model, (opt, sched), _ = _train(True, 1, steps=2)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(), "sched": sched.state_dict()}
    resumed_model = build_model("tiny-llama", seed=1)
    resumed_model.load_state_dict(saved["model"])
    rest = _train(True, 1, model=resumed_model, steps=2, start=saved)[0]
    assert first + rest == pytest.approx(full, rel=1e-6)
    # A normal optimizer over the same model reads the same state (switching technique on resume).
    plain = _make(list(model.parameters()))
    set_optimizer_state_dict(model, plain, saved["opt"])
    assert sorted(get_optimizer_state_dict(model, plain)["state"]) == sorted(saved["opt"]["state"])
    assert len(saved["opt"]["state"]) == len(list(model.parameters()))


def _gradient_peak(oib: bool, accum: int) -> tuple[int, int, int]:
    model = build_model("tiny-llama", seed=0)
    opt = OptimizerInBackward(model, _make) if oib else _make(list(model.parameters()))
    tracker = StepMemoryTracker(model, opt)
    with tracker.step():
        for micro in range(accum):
            loss = causal_lm_loss(model, _batch(micro)) / accum
            if oib:
                with opt.micro_batch(last=micro == accum - 1):
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
    param_bytes = [p.numel() * p.element_size() for p in model.parameters()]
    return tracker.last_category_maxima()["gradients"], max(param_bytes), sum(param_bytes)


def test_gradient_peak_is_one_parameter() -> None:
    normal, largest, total = _gradient_peak(False, 1)
    fused, _, _ = _gradient_peak(True, 1)
    assert normal == total  # every gradient alive at once before step()
    assert fused == largest  # one gradient at a time: the largest parameter's (embedding / lm_head)
    assert fused < normal


def test_gradient_accumulation_keeps_gradients_until_the_last_micro_batch() -> None:
    """With accumulation the earlier micro-batches must keep every gradient: no saving then."""
    fused, largest, total = _gradient_peak(True, 2)
    normal, _, _ = _gradient_peak(False, 2)
    # Every accumulated gradient, plus the incoming gradient being added to one of them.
    assert fused == normal == total + largest


def _cfg(**overrides: object) -> RunConfig:
    cfg = RunConfig()
    cfg.memory.optimizer_in_backward = True
    cfg.optim.grad_clip = 0.0
    for key, value in overrides.items():
        section, _, name = key.rpartition("__")
        setattr(getattr(cfg, section) if section else cfg, name, value)
    return cfg


def test_config_checks() -> None:
    check_optimizer_in_backward(_cfg(), "fsdp", 2)
    check_optimizer_in_backward(_cfg(), "ddp", 1)
    check_optimizer_in_backward(_cfg(optim__grad_clip=1.0, memory__optimizer_in_backward=False), "deepspeed", 2)
    cases = [
        (_cfg(optim__grad_clip=1.0), "fsdp", 2, "grad_clip=0"),
        (_cfg(precision="fp16"), "fsdp", 2, "fp16"),
        (_cfg(), "deepspeed", 1, "DeepSpeed owns"),
        (_cfg(), "ddp", 2, "DDP"),
    ]
    for cfg, kind, world, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            check_optimizer_in_backward(cfg, kind, world)
        assert "\n" not in str(info.value)
