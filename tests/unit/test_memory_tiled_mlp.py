"""Tiled MLP: the untiled MLP's outputs and gradients, a tile's worth of its activations at a time."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from harness.config import load_config, load_strategy
from harness.distributed import DistInfo
from harness.engine import build_engine, hidden_size_of, plan_engine
from harness.errors import ConfigError
from harness.memory import StepMemoryTracker, apply_activation_checkpointing, apply_tiled_mlp, mlp_tiles, tiled_mlps
from harness.models import build_model, model_spec
from harness.training import causal_lm_loss

VOCAB = 256


def _model(tiles: int = 0, ac: str = "none", **overrides: int) -> torch.nn.Module:
    model = build_model("tiny-llama", seed=0, vocab_size=VOCAB, config_overrides={"num_hidden_layers": 2, **overrides})
    if tiles:
        apply_tiled_mlp(model, tiles)
    apply_activation_checkpointing(model, ac)
    return model


def _grads(model: torch.nn.Module, seq: int = 96) -> tuple[float, list[torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
    loss = causal_lm_loss(model, ids)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_tile_count_from_a_count_or_a_size() -> None:
    assert mlp_tiles(100, tiles=4) == 4
    assert mlp_tiles(100, tile_tokens=32) == 4  # 32 + 32 + 32 + 4
    assert mlp_tiles(3, tiles=8) == 3  # never an empty tile
    assert mlp_tiles(100) == 1
    with pytest.raises(ValueError, match="not both"):
        mlp_tiles(100, tiles=2, tile_tokens=8)


@pytest.mark.parametrize("ac", ["none", "full", "op"])
def test_tiled_mlp_gives_the_untiled_loss_and_gradients(ac: str) -> None:
    base_loss, base = _grads(_model(ac=ac))
    model = _model(tiles=5, ac=ac)  # 96 tokens in 5 tiles: the last one shorter
    assert tiled_mlps(model) == 2
    loss, grads = _grads(model)
    assert loss == pytest.approx(base_loss, rel=1e-6)
    for g, b in zip(grads, base, strict=True):
        torch.testing.assert_close(g, b, rtol=1e-5, atol=1e-7)


def test_tiled_mlp_with_lora_trains_the_same_adapters() -> None:
    from harness.models import apply_lora

    cfg = load_config(None, ["lora.enabled=true", "lora.r=4", "lora.target_modules=[gate_proj,up_proj,down_proj,q_proj]"]).lora

    def adapters(tiles: int) -> tuple[float, list[torch.Tensor]]:
        model = build_model("tiny-llama", seed=0, vocab_size=VOCAB, config_overrides={"num_hidden_layers": 2})
        model = apply_lora(model, cfg, seed=0)
        if tiles:
            apply_tiled_mlp(model, tiles)
        apply_activation_checkpointing(model, "full")
        return _grads(model)

    (base_loss, base), (loss, grads) = adapters(0), adapters(3)
    assert loss == pytest.approx(base_loss, rel=1e-6) and len(grads) == len(base) > 0
    for g, b in zip(grads, base, strict=True):
        torch.testing.assert_close(g, b, rtol=1e-5, atol=1e-7)


def test_tiled_mlp_keeps_names_and_refuses_a_second_tiling() -> None:
    plain, tiled = _model(), _model(tiles=4, ac="full")
    assert list(tiled.state_dict()) == list(plain.state_dict())
    with pytest.raises(ValueError, match="already tiled"):
        apply_tiled_mlp(tiled, 2)
    with pytest.raises(ValueError, match="exactly one"):
        apply_tiled_mlp(plain, 2, 16)


def _mlp_activation_peak(tiles: int) -> int:
    """Activation peak of one MLP's forward + backward (hidden 64, intermediate 1024: the intermediates dominate)."""
    mlp = _model(tiles, intermediate_size=1024).model.layers[0].mlp
    x = torch.randn(2, 512, 64, requires_grad=True)
    tracker = StepMemoryTracker(mlp, None)
    with tracker.step():
        mlp(x).sum().backward()
    return tracker.last_category_maxima()["activations"]


def test_tiled_mlp_divides_the_mlps_activation_peak_by_its_tiles() -> None:
    io = 2 * 2 * 512 * 64 * 4  # the output and the input's gradient: whole-sequence tensors at any tiling
    untiled = _mlp_activation_peak(0)
    assert untiled > 16 * io  # the four (2, 512, 1024) fp32 intermediates held for backward
    for tiles in (2, 4, 8):
        assert _mlp_activation_peak(tiles) - io <= (untiled - io) / tiles


def test_config_takes_a_count_or_a_size_not_both() -> None:
    assert load_config(None, ["memory.tiled_mlp=4"]).memory.tiled_mlp == 4
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["memory.tiled_mlp=4", "memory.tiled_mlp_tokens=128"])
    with pytest.raises(ConfigError, match="memory.tiled_mlp_tokens=-1 must be >= 0"):
        load_config(None, ["memory.tiled_mlp_tokens=-1"])


@pytest.fixture
def group_of_one(tmp_path, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fsdp_run(overrides: list[str]) -> tuple[list[float], list[torch.Tensor]]:
    args = ["strategy=fsdp", "memory.activation_checkpointing=full", "micro_batch_size=2", "optim.lr=0.01", *overrides]
    cfg = load_config(None, args)
    info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    spec = model_spec("tiny-llama", vocab_size=VOCAB)
    plan = plan_engine(cfg, load_strategy(cfg.strategy, env={}), 1, info.device, hidden_size_of(spec.config))
    engine = build_engine(spec, cfg, plan, info, functools.partial(causal_lm_loss, chunk_size=0))
    assert tiled_mlps(engine.module) == (len(engine.module.model.layers) if cfg.memory.tiled_mlp_tokens else 0)
    assert engine.offload_checkpoint_inputs == cfg.memory.offload_checkpoint_inputs
    batch = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        loss = engine.forward_loss(batch)
        engine.backward(loss, last_micro=True)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().full_tensor().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_with_checkpointing_trains_the_same_with_a_tiled_mlp(group_of_one, offload: bool) -> None:
    """Through the engine's own load path (tiled MLP -> AC -> FSDP2), with the checkpointed blocks'
    inputs offloaded too (on CPU: held by reference, the hooks and prefetch order run): the same steps."""
    assert os.environ["WORLD_SIZE"] == "1"
    base_losses, base = _fsdp_run([])
    losses, weights = _fsdp_run(["memory.tiled_mlp_tokens=16", f"memory.offload_checkpoint_inputs={str(offload).lower()}"])
    assert losses == pytest.approx(base_losses, rel=1e-5) and losses[-1] < losses[0]
    # Adam divides by each gradient's own running size, so a gradient near zero summed in another
    # order (tiles) moves its weight by up to lr x 1e-3 differently: 1e-5 absolute after 3 steps
    # at lr 0.01 (seen: 3.2e-6 on one of 11,264 weights on this host's kernels)
    for w, b in zip(weights, base, strict=True):
        torch.testing.assert_close(w, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_tiled_mlp_compiles_per_block_to_the_same_gradients(ac: str) -> None:
    """torch.compile (the AOTAutograd partitioner, without inductor's code generation) traces the tiles' checkpoints."""
    from harness.memory import apply_compile

    torch._dynamo.reset()
    try:
        base_loss, base = _grads(_model(ac=ac))
        model = _model(tiles=4, ac=ac)
        assert apply_compile(model, "block", backend="aot_eager_decomp_partition") == "block"
        loss, grads = _grads(model)
    finally:
        torch._dynamo.reset()
    assert loss == pytest.approx(base_loss, rel=1e-5)
    for g, b in zip(grads, base, strict=True):
        torch.testing.assert_close(g, b, rtol=1e-4, atol=1e-6)


def test_each_weight_gradient_is_accumulated_once_over_all_tiles() -> None:
    """What optimizer-in-backward (a step per parameter from this hook) and DDP's reducer rely on."""
    model = _model(tiles=4, ac="full")
    calls: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    _grads(model)
    assert calls and set(calls.values()) == {1}, calls


@pytest.mark.parametrize(("family", "masked"), [("qwen3_moe", False), ("qwen3_moe", True), ("gpt_oss", True)])
def test_a_tiled_moe_block_routes_trains_and_balances_as_untiled(family: str, masked: bool) -> None:
    """A mixture-of-experts block over sequence tiles of a batch of rows (a strided view, which
    the block flattens with `view`): its router runs once per tile, and the router loss joins each
    layer's tiles back in (row, position) order, the order of the mask that leaves some tokens out
    (`routed_tokens`, here the last 10 positions of row 0). Loss, aux loss, expert counts and every
    gradient are the untiled model's; with AC the tiles nest inside the block's checkpoint. gpt-oss's
    MLP also returns its router scores over the flattened tokens: joined in that order too."""
    from model_families import moe_configs
    from transformers import AutoModelForCausalLM

    from harness.memory import clean_fqn
    from harness.training import RouterLoss

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 32, dtype=torch.bool)
    mask[0, -10:] = False

    def run(tiles: int, ac: str) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(moe_configs(4)[family])
        router = RouterLoss(None)
        router.attach(model)
        if tiles:
            assert apply_tiled_mlp(model, tiles) == 2
        apply_activation_checkpointing(model, ac)
        if masked:
            router.routed_tokens.append(mask)
        loss = causal_lm_loss(model, ids, router=router)
        loss.backward()
        return loss.item(), router.pop(), {clean_fqn(n): p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, record, grads = run(0, "none")
    for tiles, ac in ((2, "none"), (4, "full")):
        tiled_loss, tiled_record, tiled_grads = run(tiles, ac)
        assert tiled_loss == pytest.approx(loss, rel=1e-6), (tiles, ac)
        torch.testing.assert_close(tiled_record, record, rtol=1e-6, atol=1e-9)  # the aux loss, then each layer's counts
        assert tiled_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_tiles_of_a_flattened_token_output_join_in_row_then_position_order() -> None:
    """An MLP whose output has a tensor over the positions and one over the flattened tokens (gpt-oss's
    `(hidden, router_scores)`): tiled, both are the untiled output, element for element."""
    from harness.memory.tiled_mlp import tiled_forward

    def mlp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.reshape(-1, x.shape[-1])[:, :3] + 1

    x = torch.randn(3, 8, 5, generator=torch.Generator().manual_seed(0))
    whole, tiled = mlp(x), tiled_forward(mlp, 4, 0)(x)
    assert torch.equal(tiled[0], whole[0]) and torch.equal(tiled[1], whole[1])


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("granitemoe", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        ("llama4_text", {"num_local_experts": 4, "intermediate_size_mlp": 64}),
    ],
)
def test_mlps_by_their_other_names_tile_to_the_same_gradients(family: str, extra: dict) -> None:
    """GraniteMoE's MLP is `block_sparse_moe`, Llama 4's `feed_forward`: found by `block_mlp`, tiled to
    the untiled loss and gradients. A block with no MLP module (OPT's `fc1`/`fc2`) is named in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.memory import clean_fqn, tiling_problem

    small = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, hidden_size=64, intermediate_size=64)
    config = AutoConfig.for_model(family, **small, **extra)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for tiles in (0, 2):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        if tiles:
            assert apply_tiled_mlp(model, tiles) == 2
        loss = causal_lm_loss(model, ids)
        loss.backward()
        results.append((loss.item(), {clean_fqn(n): p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (tiled_loss, tiled_grads) = results
    assert tiled_loss == pytest.approx(loss, rel=1e-6) and tiled_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-7)
    opt = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("opt", num_hidden_layers=1, hidden_size=32, num_attention_heads=4, ffn_dim=32, vocab_size=64)
    )
    problem = tiling_problem(opt)
    assert problem is not None and "OPTForCausalLM's decoder blocks hold no MLP" in problem and "memory.tiled_mlp=0" in problem
