"""torch.compile per block / whole model, the activation memory budget, compile time apart.

Most tests use the ``aot_eager_decomp_partition`` backend: the same AOTAutograd joint
graph and min-cut partitioner (where the budget acts) as inductor, without generating
C++ kernels, so each compile takes about a second. One test runs inductor itself (gcc is
present on the CPU machine) on one decoder block's MLP (~10 s with a cold inductor cache).
"""

from __future__ import annotations

import pytest
import torch

from harness.memory import CompileTimer, StepMemoryTracker, apply_activation_checkpointing, apply_compile, set_activation_memory_budget
from harness.models import build_model
from harness.training import causal_lm_loss

FAST = "aot_eager_decomp_partition"


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    yield
    set_activation_memory_budget(None)
    torch._dynamo.reset()


def _batch() -> torch.Tensor:
    return torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))


_EAGER: list[float] = []


def _eager_losses() -> list[float]:
    """The eager reference (no compile, no AC, 3 steps), computed once for the module's tests."""
    if not _EAGER:
        _EAGER.extend(_run("eager", None, ac="none")[0])
    return list(_EAGER)


def _run(
    mode: str, budget: float | None, backend: str = FAST, ac: str = "none", steps: int = 3, layers: int = 2
) -> tuple[list[float], dict, dict]:
    torch._dynamo.reset()
    model = build_model("tiny-llama", seed=0, config_overrides={"num_hidden_layers": layers})
    apply_activation_checkpointing(model, ac)
    applied = apply_compile(model, mode, budget, backend=backend) if mode != "eager" else "eager"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker, timer = StepMemoryTracker(model, opt), CompileTimer()
    assert tracker.compiled == (applied not in ("eager", "none"))
    losses = []
    for _ in range(steps):
        with timer.step(), tracker.step():
            loss = causal_lm_loss(model, _batch())
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, tracker.last_category_maxima(), timer.report()


def test_budget_sweep_orders_activation_bytes() -> None:
    results = {b: _run("block", b) for b in (1.0, 0.5, 0.0)}
    acts = {b: r[1]["activations"] for b, r in results.items()}
    assert acts[0.0] <= acts[0.5] <= acts[1.0]
    assert acts[0.0] < acts[1.0]
    # Recomputation is numerically neutral: identical losses for every budget.
    assert results[0.0][0] == results[0.5][0] == results[1.0][0]
    assert results[1.0][0] == pytest.approx(_eager_losses(), rel=1e-5)


def test_inductor_budget_zero_saves_less_than_one() -> None:
    """Inductor itself (C++ codegen with gcc) on the smallest real piece: one decoder block's MLP."""
    saved, grads = {}, {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()
        mlp = build_model("tiny-llama", seed=0).model.layers[0].mlp  # HF LlamaMLP, gated SiLU
        set_activation_memory_budget(budget)
        mlp.compile(backend="inductor")
        tracker, timer = StepMemoryTracker(mlp, None, compiled=True), CompileTimer()
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        for _ in range(2):
            x.grad = None
            with timer.step(), tracker.step():
                mlp(x).pow(2).mean().backward()
        saved[budget], grads[budget] = tracker.last_category_maxima()["activations"], x.grad.clone()
        assert timer.report()["warmup_steps"] == 1 and timer.report()["compile_s"] > 0
    # Budget 1 keeps the gate/up projections; budget 0 recomputes them from the saved input.
    assert saved[0.0] < saved[1.0]
    torch.testing.assert_close(grads[0.0], grads[1.0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode,ac", [("model", "none"), ("block", "op"), ("block", "full")])
def test_compile_modes_and_ac_match_eager(mode: str, ac: str) -> None:
    eager = _eager_losses()
    losses, _, report = _run(mode, None, ac=ac)
    assert losses == pytest.approx(eager, rel=1e-5)
    # The first step compiled (forward and backward graphs); later steps reuse them.
    assert report["warmup_steps"] == 1 and report["steady_steps"] == 2
    assert report["compile_s"] > report["steady_step_s"]


def test_compile_in_place_keeps_names_and_applies_budget() -> None:
    import torch._functorch.config as functorch_config

    plain = build_model("tiny-llama", seed=0)
    model = build_model("tiny-llama", seed=0)
    assert apply_compile(model, "block", None) == "block"
    assert list(model.state_dict()) == list(plain.state_dict())
    assert apply_compile(build_model("tiny-llama"), "none", 0.3, backend=FAST) == "model"  # a budget implies compile
    assert functorch_config.activation_memory_budget == 0.3
    with pytest.raises(ValueError, match="not one of"):
        apply_compile(plain, "layers", None)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        set_activation_memory_budget(1.5)


def test_compile_timer_without_compilation() -> None:
    timer = CompileTimer()
    for _ in range(3):
        with timer.step():
            torch.ones(8).sum()
    report = timer.report()
    assert report["warmup_steps"] == 0 and report["compile_s"] == 0.0 and report["steady_steps"] == 3


def test_a_compile_that_ran_eagerly_is_said_after_the_first_forward() -> None:
    """dynamo falls back to eager without an error (a side effect under activation checkpointing made
    every block eager with transformers 5.25): the engines say so after the first forward."""
    from harness.memory import CompiledCheck

    check = CompiledCheck("block")
    line = check.fell_back()
    assert line is not None and line.startswith("memory.compile=block: the first forward compiled no graph, so the model runs eagerly")
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    assert check.fell_back() is None


def test_checkpointed_moe_blocks_compile_below_the_checkpoint_and_match_eager() -> None:
    """A MoE block compiled whole under activation checkpointing ran eagerly: its router's
    output-capture hook reads a ContextVar dynamo cannot trace, and a graph break inside a checkpoint
    gives up the whole region. Compiled below the checkpoint (attention and experts, the router
    eager), the first forward compiles graphs, and the losses, router aux losses and gradients are
    eager's, through the trainer's own loss with its router term."""
    from model_families import moe_configs
    from transformers import AutoModelForCausalLM

    from harness.memory import CompiledCheck
    from harness.training import RouterLoss

    def run(compiled: bool) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(moe_configs(4)["qwen3_moe"])
        router = RouterLoss(None)
        router.attach(model)
        apply_activation_checkpointing(model, "full")
        if compiled:
            assert apply_compile(model, "block", None, backend=FAST) == "block"
        check, opt, losses, aux = CompiledCheck("block"), torch.optim.SGD(model.parameters(), lr=0.1), [], []
        for step in range(2):
            ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step))
            loss = causal_lm_loss(model, ids, router=router)
            if compiled and step == 0:
                assert check.fell_back() is None, check.fell_back()
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            aux.append(float(router.pop()[0]))
        return losses, aux, grads

    eager, compiled = run(False), run(True)
    assert compiled[0] == pytest.approx(eager[0], rel=1e-6) and compiled[1] == pytest.approx(eager[1], rel=1e-6)
    assert compiled[2].keys() == eager[2].keys() and any(".experts." in n for n in eager[2])
    for name, grad in eager[2].items():
        torch.testing.assert_close(compiled[2][name], grad, rtol=1e-5, atol=1e-7, msg=name)
