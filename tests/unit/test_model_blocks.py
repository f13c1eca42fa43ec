"""Model construction without memory: the meta template, the block lookup from transformers'
own metadata, checkpoint reads of a flat range, ties kept, and the pre-flight refusals."""

from __future__ import annotations

import json

import pytest
import torch
from model_families import family_configs, save_families
from transformers import LlamaForCausalLM, T5Config

from harness import plan
from harness.config import ParallelLayout, load_config, load_strategy
from harness.errors import ConfigError
from harness.models import (
    BlocksNotFound,
    CheckpointWeights,
    InitWeights,
    build_model,
    decoder_block_list,
    empty_model,
    fill,
    materialize,
)
from harness.runner.preflight import check_architecture

BLOCK_PATHS = {
    "llama": "model.layers",
    "qwen2": "model.layers",
    "opt": "model.decoder.layers",
    "gpt_neox": "gpt_neox.layers",
    "gpt2": "transformer.h",
}


@pytest.mark.parametrize("family", list(BLOCK_PATHS))
def test_blocks_found_from_no_split_modules_wherever_they_live(family):
    model = empty_model(family_configs()[family])
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    blocks = decoder_block_list(model)
    path = next(name for name, module in model.named_modules() if module is blocks)
    assert path == BLOCK_PATHS[family] and len(blocks) == 2


def test_no_declared_block_class_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(LlamaForCausalLM, "_no_split_modules", [])
    model = empty_model(family_configs()["llama"])
    for module in model.modules():
        monkeypatch.setattr(module, "_no_split_modules", [], raising=False)
    with pytest.raises(BlocksNotFound, match="_no_split_modules is empty"):
        decoder_block_list(model)


def test_tied_embeddings_stay_tied_when_materialized():
    model = materialize(empty_model(family_configs()["qwen2"]), "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta


def test_checkpoint_reads_any_flat_range_and_the_whole_model_round_trips(tmp_path):
    dirs = save_families(tmp_path)
    for family, directory in dirs.items():
        model = build_model(directory)
        ckpt = CheckpointWeights(directory, model.base_model_prefix)
        ckpt.follow_conversions(model)  # GPT-NeoX: `embed_out` in the file is `lm_head`
        for name, tensor in dict(model.named_parameters()).items():  # a tied head is named once
            tensor = tensor.detach()
            flat = tensor.reshape(-1)
            for start, end in ((0, flat.numel()), (3, min(flat.numel(), 77)), (flat.numel() // 2, flat.numel())):
                assert torch.equal(ckpt.read([name], tensor.shape, start, end).to(tensor.dtype), flat[start:end]), (family, name)
    with pytest.raises(ValueError, match="the model expects"):
        ckpt.read(["transformer.wte.weight"], (3, 3), 0, 9)


def test_init_is_the_same_for_any_range_and_follows_the_models_init():
    template = empty_model(family_configs()["llama"])
    whole = materialize(empty_model(family_configs()["llama"]), "cpu")
    assert fill(whole, InitWeights(template, seed=7)) == []  # nothing missing
    q = whole.model.layers[1].self_attn.q_proj.weight.detach()
    piece = InitWeights(template, seed=7).read(["model.layers.1.self_attn.q_proj.weight"], q.shape, 100, 300)
    assert torch.equal(piece, q.reshape(-1)[100:300])
    assert torch.equal(whole.model.norm.weight, torch.ones_like(whole.model.norm.weight))  # the model's own _init_weights
    assert 0.015 < float(q.std()) < 0.025  # initializer_range 0.02
    other = materialize(empty_model(family_configs()["llama"]), "cpu")
    fill(other, InitWeights(template, seed=8))
    assert not torch.equal(other.model.layers[1].self_attn.q_proj.weight, q)


def _cfg(path, *overrides):
    cfg = load_config(None, [f"model.name={path}", *overrides])
    return cfg, load_strategy(cfg.strategy, env={}), ParallelLayout.of(cfg.parallel, 1)


def test_preflight_refuses_a_model_transformers_cannot_build_as_a_causal_lm(tmp_path):
    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model type 't5' has no causal-LM class"):
        check_architecture(*_cfg(str(tmp_path)))


def test_preflight_names_the_settings_that_need_the_blocks(tmp_path, monkeypatch):
    directory = save_families(tmp_path)["llama"]
    check_architecture(*_cfg(directory, "strategy=fsdp", "memory.activation_checkpointing=full"))  # found: no error
    monkeypatch.setattr(LlamaForCausalLM, "_no_split_modules", [])
    monkeypatch.setattr("transformers.models.llama.modeling_llama.LlamaPreTrainedModel._no_split_modules", [])
    with pytest.raises(ConfigError, match=r"needed by strategy=fsdp .*memory.activation_checkpointing=full"):
        check_architecture(*_cfg(directory, "strategy=fsdp", "memory.activation_checkpointing=full"))
    check_architecture(*_cfg(directory, "strategy=ddp"))  # DDP without per-block settings never asks for them
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"


def test_planner_exits_2_with_one_line_when_it_cannot_trace_a_step(tmp_path, monkeypatch, capsys):
    directory = save_families(tmp_path)["llama"]
    monkeypatch.setattr(LlamaForCausalLM, "_no_split_modules", [])
    monkeypatch.setattr("transformers.models.llama.modeling_llama.LlamaPreTrainedModel._no_split_modules", [])
    capsys.readouterr()  # the checkpoint writer's progress bars
    code = plan.main(
        [
            "--gpus",
            "2",
            "--gpu-mem",
            "80GiB",
            f"model.name={directory}",
            "memory.activation_checkpointing=full",
            "data.seq_len=32",
            f"data.cache_dir={tmp_path / 'cache'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot trace a training step" in err[0] and "_no_split_modules" in err[0], err


def _config_other_than_its_weights(tmp_path) -> str:
    """A saved Llama whose config.json says a wider hidden size than its safetensors hold."""
    directory = save_families(tmp_path)["llama"]
    path = tmp_path / "llama" / "config.json"
    config = json.loads(path.read_text())
    config["hidden_size"] += 32
    path.write_text(json.dumps(config))
    return directory


def test_a_config_that_disagrees_with_its_weights_is_one_line_exit_2_before_launch(tmp_path, monkeypatch, capfd):
    from launching import call_entry_point, env

    import harness.train

    directory = _config_other_than_its_weights(tmp_path)
    argv = [f"model.name={directory}", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", "data.seq_len=32"]
    argv.append("data.vocab_size=512")  # the saved model's: the one problem is its config
    code, err, _ = call_entry_point(harness.train.main, argv, env(), monkeypatch, capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "model.embed_tokens.weight" in lines[0] and "the model expects" in lines[0] and "config.json" in lines[0], lines


def test_a_checkpoint_read_of_another_shape_is_a_config_error(tmp_path):
    directory = _config_other_than_its_weights(tmp_path)
    weights = CheckpointWeights(directory, "model")
    with pytest.raises(ConfigError, match=r"has shape \[\d+, \d+\], the model expects"):
        weights.read(["model.embed_tokens.weight"], (1, 1), 0, 1)


def test_a_bf16_embeddings_gradient_is_summed_in_fp32_on_the_cpu():
    """torch's CPU kernel sums a row's token gradients in bf16 (an error growing with the step's
    tokens); after `prepare_model` the sum is fp32's, rounded once, and everything else is torch's own."""
    from torch import nn

    from harness.config import MemoryConfig
    from harness.memory import prepare_model
    from harness.models import Fp32SumEmbedding

    gen = torch.Generator().manual_seed(0)
    ids = torch.multinomial(1 / torch.arange(1.0, 2049), 131_072, True, generator=gen).reshape(64, 2048)
    grad = torch.randn(64, 2048, 32, generator=gen).bfloat16()
    exact = torch.zeros(2048, 32).index_add_(0, ids.reshape(-1), grad.float().reshape(-1, 32))

    def error(module: nn.Module) -> float:
        module(ids).backward(grad)
        return float((module.weight.grad.float() - exact).norm() / exact.norm())

    plain = nn.Embedding(2048, 32).bfloat16()
    model = nn.Sequential(nn.Embedding(2048, 32)).bfloat16()
    prepare_model(model, MemoryConfig())
    assert type(model[0]) is Fp32SumEmbedding and list(model.state_dict()) == ["0.weight"]
    assert error(plain) > 0.03  # torch's kernel: rounded per token (0.068 measured)
    assert error(model[0]) < 2**-8  # summed in fp32, rounded once to bf16

    # padding rows take no gradient; fp32 weights (and a GPU) keep torch's kernel, to the bit
    padded, reference = nn.Embedding(2048, 32, padding_idx=1), nn.Embedding(2048, 32, padding_idx=1)
    prepare_model(padded, MemoryConfig())
    for module in (padded, reference):
        module(ids).backward(grad.float())
    assert torch.equal(padded.weight.grad, reference.weight.grad) and not padded.weight.grad[1].any()
    low = nn.Embedding(2048, 32, padding_idx=1).bfloat16()
    prepare_model(low, MemoryConfig())
    low(ids).backward(grad)
    assert not low.weight.grad[1].any()

    class Scaled(nn.Embedding):  # Gemma's: the lookup scaled by a constant
        def forward(self, ids):
            return super().forward(ids) * 2.0

    scaled = Scaled(2048, 32).bfloat16()
    prepare_model(scaled, MemoryConfig())
    assert isinstance(scaled, Scaled) and isinstance(scaled, Fp32SumEmbedding)
    scaled(ids).backward(grad)
    assert float((scaled.weight.grad.float() - 2 * exact).norm() / (2 * exact).norm()) < 2**-8
