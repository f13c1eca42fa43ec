"""fp32 causal-LM loss: equal to HF's, chunked without full logits, smaller logits peak."""

from __future__ import annotations

import pytest
import torch

from harness.memory import StepMemoryTracker
from harness.models import build_model
from harness.training.loss import IGNORE_INDEX, causal_lm_loss, shift_targets

B, S, V = 2, 64, 2048  # tiny-llama's vocabulary


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :7] = IGNORE_INDEX  # e.g. a masked prompt
    return ids, labels


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_shift_targets() -> None:
    labels = torch.tensor([[5, 6, 7, IGNORE_INDEX]])
    assert shift_targets(labels).tolist() == [[6, 7, IGNORE_INDEX, IGNORE_INDEX]]


@pytest.mark.parametrize("chunk_size", [0, 1, 17, 64, B * S, 10 * B * S])
def test_loss_and_grads_equal_hf(chunk_size: int) -> None:
    model = build_model("tiny-llama", seed=0)
    ids, labels = _batch()
    ref = model(input_ids=ids, labels=labels, use_cache=False).loss
    ref.backward()
    ref_grads = _grads(model)
    loss = causal_lm_loss(model, ids, labels, chunk_size=chunk_size)
    loss.backward()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for g, r in zip(_grads(model), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    # the installed forward leaves ordinary calls unchanged; evaluation takes the no-gradient path
    assert model(input_ids=ids).logits.shape == (B, S, V)
    with torch.no_grad():
        assert causal_lm_loss(model, ids, labels, chunk_size=chunk_size).item() == pytest.approx(ref.item(), rel=1e-6)


def test_num_items_normalises_across_micro_batches() -> None:
    """Summing micro-batch losses divided by the global token count equals the whole-batch loss."""
    model = build_model("tiny-llama", seed=0)
    ids, labels = _batch()
    whole = causal_lm_loss(model, ids, labels)
    count = (shift_targets(labels) != IGNORE_INDEX).sum()
    parts = sum(causal_lm_loss(model, ids[i : i + 1], labels[i : i + 1], chunk_size=16, num_items=count) for i in range(B))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def _step_memory(model: torch.nn.Module, chunk_size: int | None) -> tuple[int, dict[str, int]]:
    """(activation bytes held right after forward, peaks of the step); chunk None: HF's own loss."""
    ids, labels = _batch()
    model.zero_grad(set_to_none=True)
    tracker = StepMemoryTracker(model, None)
    with tracker.step():
        if chunk_size is None:
            out = model(input_ids=ids, labels=labels, use_cache=False)
            loss = out.loss
            del out  # keep only what autograd keeps
        else:
            loss = causal_lm_loss(model, ids, labels, chunk_size=chunk_size)
        held = tracker.current()["activations"]
        loss.backward()
    return held, tracker.last_peaks()


def test_chunked_loss_cuts_the_logits_peak() -> None:
    model = build_model("tiny-llama", seed=0)
    logits_fp32 = B * S * V * 4
    hf_held, hf_peak = _step_memory(model, None)
    held, peak = _step_memory(model, 0)
    chunk_held, chunk_peak = _step_memory(model, 16)
    # Unchunked: one full fp32 logits-sized tensor is kept for backward (HF: log-softmax; ours: its gradient).
    assert hf_held >= logits_fp32 and held >= logits_fp32
    # Chunked: that tensor is gone; the chunks keep only views of the hidden states, the
    # int64 targets and the int64 token count (which the unchunked path need not keep).
    assert held - chunk_held >= logits_fp32 - B * S * 8 - 8
    # Step peak: the chunked loss never materialises the logits, saving well over one copy.
    assert hf_peak["total"] - chunk_peak["total"] >= logits_fp32
    # The fused unchunked loss creates one fp32 logits-sized tensor less than HF's in
    # backward (measured: all but ~1 KiB of it); asserted with slack for the rest of the peak.
    assert hf_peak["total"] - peak["total"] > logits_fp32 // 2
    assert chunk_peak["total"] < peak["total"]


def test_bf16_model_keeps_no_fp32_logits() -> None:
    """bf16 logits: HF's loss keeps an fp32 log-softmax for backward; ours keeps a bf16 gradient."""
    model = build_model("tiny-llama", seed=0, dtype=torch.bfloat16)
    hf_held, hf_peak = _step_memory(model, None)
    held, peak = _step_memory(model, 0)
    assert hf_held - held >= B * S * V * (4 - 2)
    assert hf_peak["total"] - peak["total"] >= B * S * V * 4
    ids, labels = _batch()
    ours = causal_lm_loss(model, ids, labels)
    assert ours.dtype == torch.float32
    assert ours.item() == pytest.approx(model(input_ids=ids, labels=labels, use_cache=False).loss.item(), rel=1e-6)


def test_second_backward_is_refused() -> None:
    model = build_model("tiny-llama", seed=0)
    ids, _ = _batch()
    loss = causal_lm_loss(model, ids)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_fp16_gradient_with_loss_scaling_matches_hf() -> None:
    """The saved gradient is stored unscaled, so fp16 does not underflow the 1/N factor."""
    model = build_model("tiny-llama", seed=0, dtype=torch.float16)
    ids, labels = _batch()
    scale = 1024.0  # what a loss scaler multiplies by
    (model(input_ids=ids, labels=labels, use_cache=False).loss * scale).backward()
    ref = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    (causal_lm_loss(model, ids, labels) * scale).backward()
    grad = model.lm_head.weight.grad
    assert not ((ref != 0) & (grad == 0)).any()  # nothing underflowed that HF kept
    torch.testing.assert_close(grad.float(), ref.float(), rtol=1e-2, atol=ref.abs().max().item() * 1e-3)


def test_a_saved_model_is_built_in_training_mode(tmp_path):
    """from_pretrained returns eval mode; the trainer and the planner's measurement must see
    the model as training does (dropout on), as a preset is."""
    build_model("tiny-llama", vocab_size=64, seed=0).save_pretrained(tmp_path)
    assert build_model(str(tmp_path)).training and build_model("tiny-llama", vocab_size=64, seed=0).training
