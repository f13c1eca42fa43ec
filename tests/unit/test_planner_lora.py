"""The planner's LoRA/QLoRA steps: adapter counts against the real peft model, state bytes by
category, and `recommend` naming LoRA when no full fine-tune fits."""

from __future__ import annotations

import pytest

from harness.config import load_config
from harness.errors import EXIT_OK
from harness.models import apply_lora, build_model, trainable_counts
from harness.plan import main
from harness.planner.estimate import estimate
from harness.planner.lora import NF4_BYTES, adapter_numel, base_bytes, lora_plan, nf4_matrix_bytes
from harness.planner.recommend import Candidate, _param_info, evaluate_lora, recommend
from harness.planner.report import verdict

VOCAB = 4096
SMALL = ["model.name=small-llama", "data.seq_len=64", "micro_batch_size=1"]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, SMALL)
    return cfg, _param_info(cfg, VOCAB)


def test_adapter_count_is_the_real_models(setup):
    cfg, info = setup
    for targets in (None, ["q_proj", "v_proj"]):
        named = [f"lora.target_modules=[{','.join(targets)}]"] if targets else []
        lora = load_config(None, ["lora.enabled=true", "lora.r=8", *named]).lora
        trainable, total = trainable_counts(apply_lora(build_model("small-llama", vocab_size=VOCAB), lora, 0))
        assert adapter_numel(info, targets, 8) == trainable
        assert info.total + trainable == total


def test_state_bytes_by_category(setup):
    cfg, info = setup
    full = estimate(load_config(None, [*SMALL, "precision=bf16"]), 1, vocab_size=VOCAB)
    plan = lora_plan(info, full, mode="lora", strategy="ddp", world=1, r=8)
    a = plan.adapters
    assert plan.categories["gradients"] == 4 * a and plan.categories["optimizer_state"] == 8 * a  # adapters only
    assert plan.categories["parameters"] == 2 * info.total + 4 * a  # frozen bf16 base + fp32 adapters
    sharded = lora_plan(info, full, mode="lora", strategy="fsdp", world=2, r=8)
    assert sharded.categories["gradients"] == 2 * a and sharded.categories["parameters"] == (2 * info.total + 4 * a) // 2
    nf4 = lora_plan(info, full, mode="nf4", strategy="ddp", world=1, r=8)
    matrices = [s[0] * s[1] for n, s in zip(info.names, info.shapes) if ".layers." in n and len(s) == 2]
    linear = sum(matrices)
    assert nf4.categories["parameters"] - 4 * a == base_bytes(info, None, "nf4")
    # ~4.13 bits a weight (codes + double-quantized scales) plus ~1 KiB of code books per matrix
    assert base_bytes(info, None, "nf4") - 2 * (info.total - linear) == pytest.approx(linear * NF4_BYTES + 1092 * len(matrices), rel=1e-3)
    assert nf4.total < plan.total
    # FSDP2 shards the codes and the rest of the base; the scales stay whole on every rank
    nf4_2 = lora_plan(info, full, mode="nf4", strategy="fsdp", world=2, r=8)
    scales = sum(nf4_matrix_bytes(m)[1] for m in matrices)
    assert nf4_2.categories["parameters"] - 2 * a == (nf4.categories["parameters"] - 4 * a - scales) // 2 + scales


def test_recommend_names_lora_when_no_full_fine_tune_fits(setup):
    cfg, info = setup
    lora = evaluate_lora(cfg, Candidate("bf16", "none", 1, 1, "ddp", lora="lora"), 1, 10**12, "cuda", VOCAB, info)
    frugal = estimate(
        load_config(None, [*SMALL, "precision=bf16", "strategy=zero3_offload", "memory.activation_checkpointing=full"]), 1, vocab_size=VOCAB
    )
    cpu_mem = (frugal.load_host + frugal.host_peak) // 2  # loads the model, cannot hold the offloaded state
    assert verdict(frugal, lora.need, cpu_mem, 1).fits is False
    rec = recommend(cfg, 1, lora.need, cpu_mem=cpu_mem, target="cuda", vocab_size=VOCAB, info=info, max_traced=4)
    assert rec.best is not None and rec.best.candidate.lora == "lora", [(e.candidate.label(), e.reason) for e in rec.evaluated]
    assert "lora.enabled=true" in rec.best.candidate.overrides()
    assert not any(e.fits for e in rec.evaluated if e.candidate.lora == "none")
    assert "no full fine-tune fits" in rec.why[rec.best.candidate][0]


def test_qlora_plans_on_cpu(setup):
    cfg, info = setup
    c = Candidate("bf16", "none", 1, 1, "ddp", lora="nf4")
    assert evaluate_lora(cfg, c, 1, 10**12, "cuda", VOCAB, info).fits
    assert evaluate_lora(cfg, c, 1, 10**12, "cpu", VOCAB, info).fits  # bitsandbytes' NF4 trains on CPU
    assert "lora.quantize=nf4" in c.overrides() and "QLoRA" in c.label()


def test_plan_command_models_a_lora_config(capsys):
    argv = ["--gpu-mem", "8GiB", "--vocab-size", str(VOCAB), *SMALL, "lora.enabled=true", "precision=bf16"]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert "LoRA (base frozen)" in out and "0.15M adapter parameters" in out
    assert main([*argv, "lora.quantize=nf4", "--target", "cpu"]) == EXIT_OK
    assert "QLoRA (NF4 base" in capsys.readouterr().out
