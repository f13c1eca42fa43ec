"""StepMemoryTracker: byte-exact categories on a hand-counted MLP, switches, reports, hooks."""

from __future__ import annotations

import json

import torch
from torch import nn

from harness.config import OptimConfig
from harness.memory import CATEGORIES, StepMemoryTracker, apply_activation_checkpointing
from harness.models import build_model
from harness.training import build_optimizer, causal_lm_loss, compiles_step, optimizer_state_bytes, optimizer_step_bytes

B, D, H = 8, 16, 64  # H > D + 1 makes the ReLU moment the activation peak (see below)
F32 = 4


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    return mlp, torch.optim.SGD(mlp.parameters(), lr=1e-3, momentum=0.9), torch.randn(B, D)


def test_categories_equal_a_hand_count_to_the_byte() -> None:
    mlp, opt, x = _mlp()
    params = (D * H + H + H * D + D) * F32
    tracker = StepMemoryTracker(mlp, opt)
    for step in range(2):
        with tracker.step():
            loss = mlp(x).pow(2).sum()
            # Held for backward: ReLU's output (B*H, saved by ReLU and by the 2nd Linear),
            # the 2nd Linear's output (B*D, saved by pow) and the scalar loss. The 1st
            # Linear's output died when ReLU returned (ReLU saves its result, not its input).
            after_forward = tracker.current()
            loss.backward()
            after_backward = tracker.current()
            opt.step()
            after_step = tracker.current()
            opt.zero_grad()
        momentum = params  # SGD keeps one momentum buffer per parameter
        assert after_forward["activations"] == (B * H + B * D) * F32 + F32
        assert after_forward["parameters"] == params and after_forward["gradients"] == 0
        assert after_backward["gradients"] == params and after_backward["activations"] == F32
        assert after_backward["temporaries"] == 0
        assert after_step["optimizer_state"] == momentum
        maxima = tracker.last_category_maxima()
        # Activation maximum: inside ReLU, its input and output (B*H each) are both alive.
        assert maxima["activations"] == 2 * B * H * F32
        assert maxima["parameters"] == params and maxima["gradients"] == params
        assert maxima["optimizer_state"] == momentum
        peak = tracker.last_peaks()
        assert peak["total"] == sum(peak[c] for c in CATEGORIES)
        assert peak["total"] >= after_step["total"]
    assert tracker.peak_so_far()["total"] == max(r["peak"]["total"] for r in tracker.history)


def test_disabled_tracker_does_nothing() -> None:
    mlp, opt, x = _mlp()
    tracker = StepMemoryTracker(mlp, opt, enabled=False, layer_hooks=True)
    hooks_before = (len(nn.modules.module._global_forward_pre_hooks), len(nn.modules.module._global_forward_hooks))
    with tracker.step():
        hooks_inside = (len(nn.modules.module._global_forward_pre_hooks), len(nn.modules.module._global_forward_hooks))
        mlp(x).sum().backward()
    assert hooks_inside == hooks_before
    assert tracker.history == [] and tracker.last_peaks() == {} and tracker.peak_so_far() == {}


def test_category_every_measures_selected_steps() -> None:
    mlp, opt, x = _mlp()
    tracker = StepMemoryTracker(mlp, opt, category_every=3)
    for _ in range(7):
        with tracker.step():
            mlp(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert [r["step"] for r in tracker.history if "peak" in r] == [0, 1, 3, 6]


def test_request_split_and_every_zero() -> None:
    """category_every=0 splits steps 0 and 1 only; request_split (SIGUSR2 in a run) splits the next step once."""
    mlp, opt, x = _mlp()
    tracker = StepMemoryTracker(mlp, opt, category_every=0)
    for i in range(6):
        if i == 3:
            tracker.request_split()
        with tracker.step():
            mlp(x).sum().backward()
    assert [r["step"] for r in tracker.history if "peak" in r] == [0, 1, 3]


def test_peak_counter_every_step_and_reset_per_step() -> None:
    """Unsplit steps still report the platform's peak (CPU: the resident high-water mark), and the
    mark is the step's own: a 64 MiB temporary shows in its step and not in the next."""
    mlp, opt, x = _mlp()
    tracker = StepMemoryTracker(mlp, opt, category_every=0)
    big = 64 << 20
    for i in range(4):
        with tracker.step():
            mlp(x).sum().backward()
            if i == 2:
                t = torch.ones(big // 4)  # touched pages: resident
                del t
    rss = [r["host_rss"] for r in tracker.history]
    assert all(v > 0 for v in rss) and "peak" not in tracker.history[2]
    assert tracker.last_peaks()["host_rss"] == rss[-1]
    if tracker.counters.resets_per_step:  # Linux with a writable /proc/self/clear_refs (CI)
        assert rss[2] - rss[1] >= big * 0.9 and rss[2] - rss[3] >= big * 0.9, rss
    else:
        assert rss == sorted(rss)  # the lifetime peak: never falls


def test_bf16_halves_parameter_bytes() -> None:
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model("tiny-llama", seed=0, dtype=dtype)
        tracker = StepMemoryTracker(model, None)
        with tracker.step():
            causal_lm_loss(model, torch.randint(0, 2048, (2, 16))).backward()
        sizes[dtype] = tracker.last_category_maxima()
        assert sizes[dtype]["parameters"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert 2 * sizes[torch.bfloat16]["parameters"] == sizes[torch.float32]["parameters"]
    assert 2 * sizes[torch.bfloat16]["gradients"] == sizes[torch.float32]["gradients"]


def test_gradient_accumulation_in_one_step() -> None:
    """Several forwards of the root in one measured step (MemTracker alone refuses the second)."""
    model = build_model("tiny-llama", seed=0)
    tracker = StepMemoryTracker(model, None)
    with tracker.step():
        for micro in range(3):
            (causal_lm_loss(model, torch.randint(0, 2048, (2, 16))) / 3).backward()
    assert tracker.last_category_maxima()["gradients"] == sum(p.numel() * 4 for p in model.parameters()) + max(
        p.numel() * 4 for p in model.parameters()
    )  # accumulated grads + the incoming one


def test_snapshot_writes_the_per_module_report(tmp_path) -> None:
    model = build_model("tiny-llama", seed=0)
    tracker = StepMemoryTracker(model, None, snapshot_dir=str(tmp_path), snapshot_step=1)
    for _ in range(2):
        with tracker.step():
            causal_lm_loss(model, torch.randint(0, 2048, (2, 16))).backward()
        model.zero_grad()
    assert tracker.snapshot_path == str(tmp_path / "memory_report_step1.json")
    report = json.loads((tmp_path / "memory_report_step1.json").read_text())
    assert report["peak"]["cpu"]["total"] == tracker.last_peaks()["total"]
    layer = report["modules"]["LlamaForCausalLM.model.layers.0"]
    assert layer["parameter_mem"] == sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    assert "Peak-Backward" in layer and "Post-Forward" in layer


def test_layer_hooks_report_what_each_block_holds() -> None:
    held = {}
    for ac in ("none", "full"):
        model = build_model("tiny-llama", seed=0, config_overrides={"num_hidden_layers": 3})
        apply_activation_checkpointing(model, ac)
        tracker = StepMemoryTracker(model, None, layer_hooks=True)
        with tracker.step():
            causal_lm_loss(model, torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))).backward()
        layers = tracker.last_layer_bytes()
        assert [entry["block"] for entry in layers] == [0, 1, 2]  # forward only, not AC recomputation
        held[ac] = [entry["held"] for entry in layers]
    assert all(h > 0 for h in held["none"])
    # A checkpointed block leaves only its output hidden states (2 x 16 tokens x hidden 64, fp32);
    # its input is the previous block's output, already counted there.
    assert held["full"] == [2 * 16 * 64 * 4] * 3
    assert all(f < n for f, n in zip(held["full"], held["none"]))


def test_a_torchao_step_compiles_under_the_tracker(monkeypatch) -> None:
    """torchao compiles its optimizer step itself (fullgraph=True); under MemTracker's dispatch
    mode dynamo compiles nothing and that raised "found no compiled frames" on the first step of
    every run with a torchao optimizer (or ran the step eagerly: minutes per step on SmolLM2-135M).
    Such steps are split by LiveBytes; the quantized states count their codes, scales and code books."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False))  # 4096 elements: quantized
    opt = build_optimizer(mlp.parameters(), OptimConfig(name="adamw_8bit", lr=1e-2))
    assert compiles_step(opt) and not compiles_step(torch.optim.AdamW(mlp.parameters()))
    before = [p.detach().clone() for p in mlp.parameters()]
    tracker = StepMemoryTracker(mlp, opt)
    x = torch.randn(B, 64)
    for _ in range(2):  # steps 0 and 1 are both split by category
        with tracker.step():
            mlp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert [r["method"] for r in tracker.history] == ["saved-tensors", "saved-tensors"]
    assert all(not torch.equal(p, q) for p, q in zip(mlp.parameters(), before, strict=True))
    held = sum(optimizer_state_bytes("adamw_8bit", p.numel(), p.dtype) + optimizer_step_bytes("adamw_8bit") for p in mlp.parameters())
    assert tracker.history[-1]["category_max"]["optimizer_state"] == held
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # torchao's step then runs eagerly: the dispatch split is safe
    assert not compiles_step(opt)
