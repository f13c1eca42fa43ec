"""What pruning asks the engine: post-step hooks and gradient probes, on the real single-process
engine (tiny Llama, CPU, a few seconds; nothing launched)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from harness.config import load_config, load_strategy
from harness.distributed import Collectives, DistInfo
from harness.engine import GradientProbe, build_engine, gradient_probe, plan_engine
from harness.models import build_model, model_spec
from harness.training import causal_lm_loss


def tiny_engine(tmp_path, *overrides: str):
    cfg = load_config(None, ["model.name=tiny-llama", f"output_dir={tmp_path}", *overrides])
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    plan = plan_engine(cfg, load_strategy("ddp"), 1, info.device, None)
    return build_engine(model_spec("tiny-llama", vocab_size=64), cfg, plan, info, functools.partial(causal_lm_loss, chunk_size=0))


@pytest.mark.parametrize("overrides", [[], ["memory.optimizer_in_backward=true"]], ids=["torch_optimizer", "in_backward"])
def test_post_step_hook_runs_after_every_step_until_removed(tmp_path, overrides: list[str]) -> None:
    """A torch optimizer's own step post-hook; an optimizer with none (stepping inside backward,
    as DeepSpeed's own also has none) is covered by the engine's `step`."""
    engine = tiny_engine(tmp_path, *overrides)
    batch = torch.randint(0, 64, (2, 16))
    calls: list[float] = []
    weight = next(p for p in engine.module.parameters() if p.dim() == 2)
    handle = engine.register_post_step_hook(lambda: calls.append(float(weight.detach().abs().sum())))
    for _ in range(2):
        engine.backward(engine.forward_loss(batch), last_micro=True)
        engine.step()
    assert len(calls) == 2 and calls[0] != calls[1]  # after each update, seeing the updated weights
    handle.remove()
    engine.backward(engine.forward_loss(batch), last_micro=True)
    engine.step()
    assert len(calls) == 2


def test_the_engines_probe_accumulates_a_probe_step_without_stepping(tmp_path) -> None:
    """The engine's probe (accumulation 2) gives the gradient of the mean over a probe step's two
    micro-batches, computed by hand on the same model; the optimizer does not step."""
    engine = tiny_engine(tmp_path, "grad_accum=2")
    probe = engine.gradient_probe()
    assert isinstance(probe, GradientProbe) and probe.accum == 2 and probe.module is engine.module
    assert gradient_probe(engine).accum == 2  # the same answer through the package function
    batches = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    before = [p.detach().clone() for p in engine.module.parameters()]
    probe.zero_grad()
    with engine.backward_without_step():
        probe.backward_step([functools.partial(engine.forward_loss, b) for b in batches])
    got = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.module.zero_grad(set_to_none=True)
    sum(engine.forward_loss(b) for b in batches).div(2).backward()
    want = {n: p.grad for n, p in engine.module.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_whole_weights_are_probed_alone_and_ddp_averages_after() -> None:
    """A plain module's weights may be probed alone; the probe of a bare module averages nothing
    (one process), leaving the gradients the caller accumulated as they are."""
    model = build_model("tiny-llama")
    probe = gradient_probe(model, 3)
    assert probe.accum == 3 and probe.module is model
    params = [p for p in model.parameters() if p.dim() == 2][:2]
    assert probe.computes_alone(params)
    frozen = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
    assert not probe.computes_alone([frozen])
    for p in params:
        p.grad = torch.ones_like(p)
    with probe.partial_backward(params, Collectives()):
        pass
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)
