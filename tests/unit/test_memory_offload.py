"""Activation offloading, as far as a CPU-only machine can show it.

Proven here: the hooks run on every saved tensor; activations (not parameters, not tiny
tensors) are held by the offload store from forward until their backward and released
after it; the copy path (``copy_on_host=True``) gives bit-identical losses and gradients;
shared saves are copied once; retain_graph works; it composes with activation
checkpointing. NOT provable without an accelerator: that device memory drops (on CPU the
device *is* the host), pinned-memory allocation and the asynchronous device<->host copies.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from harness.memory import ActivationOffload, apply_activation_checkpointing
from harness.models import build_model
from harness.training import causal_lm_loss


def _batch() -> torch.Tensor:
    return torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))


def _loss_and_grads(model: torch.nn.Module, offload: ActivationOffload | None) -> tuple[float, list[torch.Tensor], int]:
    model.zero_grad(set_to_none=True)
    held_after_forward = 0
    if offload is None:
        loss = causal_lm_loss(model, _batch())
    else:
        with offload:
            loss = causal_lm_loss(model, _batch())
        held_after_forward = offload.store_bytes
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], held_after_forward


def _saved_tensor_bytes(model: torch.nn.Module, min_bytes: int) -> int:
    """Independent count: bytes of distinct non-parameter tensors autograd saves, >= min_bytes."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter) and nbytes >= min_bytes:
            seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        causal_lm_loss(model, _batch())
    return sum(seen.values())


@pytest.mark.parametrize("copy_on_host", [False, True])
def test_offload_is_bit_identical_and_holds_the_activations(copy_on_host: bool) -> None:
    model = build_model("tiny-llama", seed=0)
    ref_loss, ref_grads, _ = _loss_and_grads(model, None)
    offload = ActivationOffload(min_bytes=1024, copy_on_host=copy_on_host)
    loss, grads, held = _loss_and_grads(model, offload)
    assert loss == ref_loss
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    stats = offload.stats
    assert stats.packed == stats.offloaded + stats.kept + stats.deduplicated
    assert stats.offloaded > 0 and stats.deduplicated > 0  # q/k/v share their input: one copy
    assert stats.reasons["parameter"] > 0  # weights stay where they are
    # The store held exactly the saved activations, and backward released all of them.
    assert held == stats.offloaded_bytes == stats.peak_store_bytes == _saved_tensor_bytes(model, 1024)
    assert offload.store_bytes == 0
    assert stats.unpacked >= stats.offloaded


def test_offload_with_retain_graph() -> None:
    model = build_model("tiny-llama", seed=0)
    x = torch.randn(4, 64, requires_grad=True)
    offload = ActivationOffload(min_bytes=0, copy_on_host=True)
    with offload:
        y = model.model.layers[0].mlp(x).pow(2).sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()
    torch.testing.assert_close(x.grad, 2 * first)
    del y
    assert offload.store_bytes == 0


def test_offload_composes_with_activation_checkpointing() -> None:
    plain = build_model("tiny-llama", seed=0)
    ref_loss, ref_grads, _ = _loss_and_grads(plain, None)
    model = build_model("tiny-llama", seed=0)
    apply_activation_checkpointing(model, "full")
    offload = ActivationOffload(min_bytes=1024, copy_on_host=True)
    loss, grads, held = _loss_and_grads(model, offload)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    # Inside checkpointed blocks checkpointing owns the saved tensors: less is offloaded.
    _, _, held_plain = _loss_and_grads(plain, ActivationOffload(min_bytes=1024, copy_on_host=True))
    assert 0 < held < held_plain


LAYERS = 4


def _checkpointed(seq: int = 64) -> tuple[torch.nn.Module, int]:
    """A full-AC model and the bytes of one block's input (micro-batch 2 x seq x hidden 64, fp32)."""
    model = build_model("tiny-llama", seed=0, vocab_size=256, config_overrides={"num_hidden_layers": LAYERS})
    apply_activation_checkpointing(model, "full")
    return model, 2 * seq * 64 * 4


def _ids(seq: int = 64) -> torch.Tensor:
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_checkpoint_inputs_alone_move_and_come_back_a_bounded_few_at_a_time(prefetch: int) -> None:
    model, block_bytes = _checkpointed()
    ref = causal_lm_loss(model, _ids())
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    offload = ActivationOffload(copy_on_host=True, scope="checkpoint_inputs", model=model, prefetch=prefetch)
    with offload:
        loss = causal_lm_loss(model, _ids())
    held = offload.store_bytes
    loss.backward()
    assert loss.item() == ref.item()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref_grads))
    stats = offload.stats
    # exactly one input per checkpointed block went to the host; everything else saved outside the blocks stayed
    assert stats.offloaded == LAYERS and held == stats.offloaded_bytes == LAYERS * block_bytes
    assert stats.reasons["not a checkpoint input"] > 0
    assert stats.prefetched == (LAYERS - 1 if prefetch else 0)
    assert stats.peak_fetched_bytes == min(prefetch + 1, LAYERS) * block_bytes  # the one unpacked and those ahead
    assert offload.store_bytes == 0 and offload.fetched_bytes == 0


def test_simulated_offload_releases_the_inputs_until_backward_fetches_them() -> None:
    """The planner's mode: device bytes held after forward drop by exactly what went to the host."""
    from harness.memory import StepMemoryTracker

    def held_after_forward(simulate: bool) -> tuple[int, ActivationOffload | None]:
        model, _ = _checkpointed()
        offload = ActivationOffload(scope="checkpoint_inputs", model=model, simulate=True) if simulate else None
        tracker = StepMemoryTracker(model, None)
        with tracker.step():
            with offload or contextlib.nullcontext():
                loss = causal_lm_loss(model, _ids())
            held = tracker.current()["activations"]
            loss.backward()
        return held, offload

    (plain, _), (held, offload) = held_after_forward(False), held_after_forward(True)
    block_bytes = _checkpointed()[1]
    assert offload.stats.offloaded_bytes == LAYERS * block_bytes
    assert held == plain - LAYERS * block_bytes


def test_checkpoint_input_offload_config_rules() -> None:
    from harness.config import load_config
    from harness.errors import ConfigError

    ok = ["memory.offload_checkpoint_inputs=true", "memory.activation_checkpointing=full"]
    assert load_config(None, ok).memory.offload_checkpoint_inputs
    for extra, why in (
        (["memory.activation_checkpointing=none"], "none without memory.activation_checkpointing"),
        (["memory.activation_offload=true"], "already offloads every saved tensor"),
        (["memory.compile=block"], "memory.compile=none"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config(None, [*ok, *extra])
    with pytest.raises(ValueError, match="needs the model"):
        ActivationOffload(scope="checkpoint_inputs")


def test_the_engine_keeps_one_offload_and_one_side_stream_for_every_micro_batch(tmp_path, monkeypatch) -> None:
    """The engine builds its checkpoint-input offload once and enters it around every training
    forward, so there is one CUDA side stream per engine: torch's caching allocator reuses a block
    allocated on a stream only on that stream, so a new stream per micro-batch would leave each
    one's blocks reserved. On CPU no stream is made (the inputs stay where they are): the stream is
    asked for with a CUDA tensor's stand-in and torch.cuda.Stream counted. Not proven here: the
    reserved memory on a GPU."""
    import functools
    import types

    from harness.config import load_config, load_strategy
    from harness.distributed import DistInfo
    from harness.engine import base, build_engine, plan_engine
    from harness.models import model_spec

    built: list[ActivationOffload] = []

    class Counted(ActivationOffload):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    streams: list[object] = []

    class Stream:  # torch.cuda.Stream's stand-in: counted
        def __init__(self, device: torch.device) -> None:
            streams.append(self)

    monkeypatch.setattr(base, "ActivationOffload", Counted)
    overrides = ["memory.offload_checkpoint_inputs=true", "memory.activation_checkpointing=full", f"output_dir={tmp_path}"]
    cfg = load_config(None, ["model.name=tiny-llama", *overrides])
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    plan = plan_engine(cfg, load_strategy("ddp"), 1, info.device, None)
    spec = model_spec("tiny-llama", vocab_size=64)
    engine = build_engine(spec, cfg, plan, info, functools.partial(causal_lm_loss, chunk_size=0))
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    layers = engine.module.config.num_hidden_layers
    cuda_input = types.SimpleNamespace(device=torch.device("cuda", 0))
    side_streams = []
    for micro in range(3):
        with engine.micro_batch(last=micro == 2):
            loss = engine.forward_loss(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(micro)))
            assert len(built) == 1 and built[0].stats.offloaded == layers  # each micro-batch's block inputs, in the one store
            side_streams.append(built[0]._side_stream(cuda_input))
            engine.backward(loss, last_micro=micro == 2)
        assert built[0].store_bytes == 0
    engine.step()
    assert len(streams) == 1 and all(s is streams[0] for s in side_streams)
    with torch.no_grad():
        engine.eval_loss_sum(torch.randint(0, 64, (2, 16)))  # evaluation offloads nothing, and builds nothing
    assert len(built) == 1 and built[0].stats.offloaded == layers
