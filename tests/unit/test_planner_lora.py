"""The planner's LoRA/QLoRA steps: adapter counts against the real peft model, state bytes by
category, and `recommend` naming LoRA when no full fine-tune fits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config import load_config, load_strategy
from harness.distributed import DistInfo
from harness.engine import build_engine, hidden_size_of, plan_engine
from harness.errors import EXIT_OK
from harness.models import apply_lora, build_model, model_config, model_spec, preset_config, trainable_counts
from harness.plan import main
from harness.planner.candidates import Candidate
from harness.planner.estimate import cached_trace, estimate, specs_for
from harness.planner.lora import NF4_BYTES, nf4_matrix_bytes, quantized_base_bytes, quantized_linears
from harness.planner.params import param_info
from harness.planner.recommend import _param_info, evaluate_lora, recommend
from harness.planner.report import verdict
from harness.planner.trace import TraceSpec, build_fake_model, trace_step
from harness.training import causal_lm_loss, optimizer_shared_bytes, optimizer_state_bytes, optimizer_step_bytes

VOCAB = 4096
SMALL = ["model.name=small-llama", "data.seq_len=64", "micro_batch_size=1"]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, SMALL)
    return cfg, _param_info(cfg.model.name, VOCAB)


def test_traced_lora_model_is_the_real_one(setup):
    """The trace builds the model the trainer trains: the same adapters (trainable) on the same frozen base."""
    cfg, info = setup
    for targets in (None, ["q_proj", "v_proj"]):
        named = [f"lora.target_modules=[{','.join(targets)}]"] if targets else []
        lora = load_config(None, ["lora.enabled=true", "lora.r=8", *named]).lora
        trainable, total = trainable_counts(apply_lora(build_model("small-llama", vocab_size=VOCAB), lora, 0))
        traced = param_info(build_fake_model("small-llama", VOCAB, FakeTensorMode(), torch.bfloat16, lora))
        assert traced.total == trainable and traced.frozen == info.total == total - trainable


def test_lora_state_bytes_by_category(setup):
    cfg, info = setup
    lora = load_config(None, [*SMALL, "precision=bf16", "lora.enabled=true"])
    est = estimate(lora, 1, vocab_size=VOCAB)
    a = est.params_total  # the adapters: all that trains
    end = next(m for m in est.moments if m.name == "end of backward").categories
    adapters = [p for p in apply_lora(build_model("small-llama", vocab_size=VOCAB), lora.lora, 0).parameters() if p.requires_grad]
    assert sum(p.numel() for p in adapters) == a
    # bf16 adapters, two bf16 Adam states, and the fused step's fp32 counter of each adapter on the device
    assert end["gradients"] == 2 * a and end["optimizer_state"] == 2 * 2 * a + 4 * len(adapters)
    assert end["parameters"] == 2 * (info.total + a)  # frozen bf16 base + adapters
    # The step's activations are the LoRA model's own (frozen linears save no input for a weight
    # gradient), not those at the full fine-tune's peak moment (its optimizer step: none).
    spec = TraceSpec("small-llama", VOCAB, 1, 1, 64, "bf16", "plain", "bf16")
    full_acts = max(trace_step(spec).category("activations"))
    lora_acts = max(trace_step(dataclasses.replace(spec, lora=(8, 16.0, 0.0, None, None))).category("activations"))
    assert 0 < lora_acts < full_acts
    assert est.peak.categories["activations"] == lora_acts
    q = estimate(load_config(None, [*SMALL, "precision=bf16", "lora.enabled=true", "lora.quantize=nf4"]), 1, vocab_size=VOCAB)
    matrices = [s[0] * s[1] for n, s in zip(info.names, info.shapes) if ".layers." in n and len(s) == 2]
    linear = sum(matrices)
    lora_info = param_info(build_fake_model("small-llama", VOCAB, FakeTensorMode(), lora=lora.lora))
    base = quantized_base_bytes(lora_info, "nf4", 2)  # the rest of the base in bf16 (one process casts it)
    # ~4.13 bits a weight (codes + double-quantized scales) plus ~1 KiB of code books per matrix
    assert base - 2 * (info.total - linear) == pytest.approx(linear * NF4_BYTES + 1092 * len(matrices), rel=1e-3)
    assert q.peak.categories["parameters"] == base + 2 * a  # bf16 adapters: the one-process module is cast
    assert q.peak.categories["activations"] == est.peak.categories["activations"]  # the traced LoRA model's
    # FSDP2 shards the codes and the rest of the base (fp32 master shards); the scales stay whole on every rank
    scales = sum(nf4_matrix_bytes(m)[1] for m in matrices)
    assert quantized_base_bytes(lora_info, "nf4", 4, 2) == (quantized_base_bytes(lora_info, "nf4", 4) - scales) // 2 + scales


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


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_4bit", "adamw_bf16", "paged_adamw_8bit"])
def test_lora_adapter_state_follows_the_optimizer(name):
    """The adapters' optimizer state is `optimizer_state_bytes` of the optimizer the run names (its
    quantized moments, block scales and code books), not fp32 AdamW's 8 bytes an element."""
    run = load_config(None, [*SMALL, "lora.enabled=true", "lora.r=16", f"optim.name={name}"])
    est = estimate(run, 1, target="cpu", vocab_size=VOCAB)
    adapters = param_info(build_fake_model("small-llama", VOCAB, FakeTensorMode(), torch.float32, run.lora))
    expected = sum(optimizer_state_bytes(name, n, torch.float32) for n in adapters.numels)
    expected += optimizer_shared_bytes(name, adapters.numels) + optimizer_step_bytes(name) * len(adapters.numels)
    end = next(m for m in est.moments if m.name == "end of backward").categories
    assert end["optimizer_state"] == expected
    assert expected < 0.6 * 2 * 4 * adapters.total  # well below fp32 AdamW's two fp32 moments


def test_qlora_under_fsdp2_cpu_offload_keeps_only_the_quantization_state_on_the_device():
    """The NF4 codes, the rest of the base and the adapters are FSDP2's shards: on the host under
    CPU offload; the quantization state is the modules' own and stays on the device."""
    qlora = [*SMALL, "precision=bf16", "lora.enabled=true", "lora.quantize=nf4", "memory.activation_checkpointing=full"]
    sharded = estimate(load_config(None, [*qlora, "strategy=fsdp"]), 2, target="cuda", vocab_size=VOCAB)
    offloaded = estimate(load_config(None, [*qlora, "strategy=fsdp_offload"]), 2, target="cuda", vocab_size=VOCAB)
    info = param_info(build_fake_model("small-llama", VOCAB, FakeTensorMode(), torch.bfloat16, load_config(None, qlora).lora))
    codes, state = (sum(nf4_matrix_bytes(s[0] * s[1], 2, 2)[i] for _, s in quantized_linears(info)) for i in (0, 1))
    sharded_end, offloaded_end = (next(m for m in e.moments if m.name == "end of backward").categories for e in (sharded, offloaded))
    assert offloaded_end["parameters"] == state > 0  # between the groups' gathers: the state alone
    # at the peak also what FSDP2 has gathered (unsharded on the device): the traced bytes beyond the shards
    assert offloaded.peak.categories["parameters"] > state
    assert offloaded.peak.categories["gradients"] == 0 and offloaded.peak.categories["optimizer_state"] == 0
    # the host holds what the device held without offload, less the state, each shard a pinned block (rounded up)
    shards = sharded_end["parameters"] - state
    assert shards < offloaded.host["parameters"] < 2 * shards
    assert offloaded.host["parameters"] > codes and offloaded.host["optimizer_state"] > 0
    assert offloaded.total < sharded.total
    assert verdict(offloaded, 10**12, None, 2).fits


def test_qlora_adapters_are_planned_in_the_dtype_the_trainer_holds_them():
    """One process under precision=bf16 casts the module, all but the quantized linears, so the
    adapters are bf16 and so are their AdamW moments (not the fp32 of peft's own default): the
    plan's parameters are the trainer's engine's to the byte, its optimizer state bf16 moments."""
    cfg = load_config(None, [*SMALL, "precision=bf16", "lora.enabled=true", "lora.quantize=nf4", "strategy=ddp"])
    spec = model_spec(cfg.model.name, vocab_size=VOCAB)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    plan = plan_engine(cfg, load_strategy(cfg.strategy), 1, info.device, hidden_size_of(spec.config))
    engine = build_engine(spec, cfg, plan, info, causal_lm_loss)
    adapters = [p for p in engine.model.parameters() if p.requires_grad]
    assert {p.dtype for p in adapters} == {torch.bfloat16}
    est = estimate(cfg, 1, target="cpu", vocab_size=VOCAB)
    end = next(m for m in est.moments if m.name == "end of backward").categories
    assert end["parameters"] == engine.state_bytes()["params"]
    a = sum(p.numel() for p in adapters)
    assert end["optimizer_state"] == 2 * 2 * a + 4 * len(adapters)  # two bf16 moments, the fused step's fp32 counter


@pytest.mark.parametrize("world", [1, 2])
def test_qlora_under_fsdp2_keeps_the_gathered_groups_the_trace_holds(world, tmp_path):
    """FSDP2 copies each group it gathers into unsharded parameters (at world 1 too, with no
    collective), so a traced op holds the rank's shards plus the groups running. QLoRA's formula
    replaces the shards only (it adds the quantization state the trace cannot build): the peak
    keeps what the trace holds beyond them there, as a LoRA plan keeps the traced bytes. Tied
    embeddings (SmolLM2's) put the embedding in the root group, gathered from the first op to the
    end of backward."""
    preset_config("small-llama", vocab_size=VOCAB, tie_word_embeddings=True).save_pretrained(tmp_path)
    shape = [f"model.name={tmp_path}", "data.seq_len=64", "micro_batch_size=1"]
    cfg = load_config(None, [*shape, "precision=bf16", "lora.enabled=true", "lora.quantize=nf4", "strategy=fsdp"])
    est = estimate(cfg, world, target="cpu", vocab_size=VOCAB)
    hidden = hidden_size_of(model_config(str(tmp_path)))
    trace = cached_trace(specs_for(cfg, load_strategy(cfg.strategy), world, hidden, "cpu", VOCAB)[0])
    params = trace.category("parameters")
    held = trace.held_param_bytes
    assert held == params[0] > 0  # the shards, before anything is gathered
    lora_info = param_info(build_fake_model(str(tmp_path), VOCAB, FakeTensorMode(), lora=cfg.lora))
    shards = quantized_base_bytes(lora_info, "nf4", 2, world) + 4 * lora_info.total // world  # bf16 base, fp32 adapter masters
    end = next(m for m in est.moments if m.name == "end of backward").categories
    assert end["parameters"] == shards  # FSDP2 has resharded every group
    peak = max(range(len(trace.rows)), key=lambda i: trace.total(i) + trace.gloo_extra.get(i, 0))
    assert params[peak] > held and est.peak.categories["parameters"] == shards + params[peak] - held
