"""Mixture-of-experts checkpoints, whatever their expert layout on disk, at world 1 in one process.

transformers 5 holds each MoE layer's experts as one stacked tensor per projection
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); its `save_pretrained` writes Qwen3-MoE,
Mixtral and OLMoE one tensor per expert (the Hub's layout: `mlp.experts.E.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.E.w1.weight`) and gpt-oss stacked. harness reads them by transformers' own
converters (`harness.models.conversions`); here, for each family: the weights and logits are
`from_pretrained`'s, any flat range of a stacked tensor (what a ZeRO-3 rank reads) is the same
range of transformers' tensor, a step trains, and the harness checkpoint exported and read back by
`from_pretrained` gives the trained model's logits. The sharded load (FSDP2 at world 2) is measured
in tests/integration/test_model_loading.py; the expert count disagreeing with config.json is refused
through `harness.train` below.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from model_families import save_moe_families
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import harness.models.conversions
from harness.checkpoint import CheckpointManager, export_hf
from harness.config import load_config, load_strategy
from harness.distributed import DistInfo
from harness.engine import build_engine, plan_engine
from harness.models import CheckpointWeights, empty_model, model_config, model_spec
from harness.training import causal_lm_loss

PER_EXPERT = {
    "qwen3_moe": "mlp.experts.0.gate_proj.weight",
    "mixtral": "block_sparse_moe.experts.0.w1.weight",
    "olmoe": "mlp.experts.0.up_proj.weight",
}
FAMILIES = [*PER_EXPERT, "gpt_oss"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return save_moe_families(tmp_path_factory.mktemp("moe"))


def _keys(directory: str) -> set[str]:
    with safe_open(f"{directory}/model.safetensors", "pt") as f:
        return set(f.keys())


def _logits(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(batch).logits
    model.train(was)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_loads_as_transformers_does_trains_and_exports_what_it_reads_back(moe_dirs, family, tmp_path):
    directory = moe_dirs[family]
    keys = _keys(directory)
    if family in PER_EXPERT:  # the Hub's layout: one tensor per expert and projection
        assert f"model.layers.0.{PER_EXPERT[family]}" in keys and not any(k.endswith("experts.gate_up_proj") for k in keys)
    else:  # gpt-oss: stacked on disk too
        assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    reference = AutoModelForCausalLM.from_pretrained(directory)
    expected = reference.state_dict()

    cfg = load_config(None, [f"model.name={directory}", f"output_dir={tmp_path / 'run'}", "precision=fp32", "optim.lr=0.01"])
    strategy = load_strategy("ddp")
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    spec = model_spec(directory)
    plan = plan_engine(cfg, strategy, 1, info.device, None)
    engine = build_engine(spec, cfg, plan, info, functools.partial(causal_lm_loss, chunk_size=0))
    model = engine.module
    got = model.state_dict()
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(model, batch), _logits(reference, batch))

    # any flat range of a stacked tensor, as a ZeRO-3 partition cuts it (mid-expert too)
    ckpt = spec.source(empty_model(spec.config))
    stacked = [k for k, v in expected.items() if ".experts." in k and v.dim() == 3]
    assert len(stacked) == 4  # gate_up and down in each of the 2 layers
    for name in stacked:
        flat = expected[name].reshape(-1)
        for start, end in ((0, flat.numel()), (5, 3001), (flat.numel() // 2 - 7, flat.numel())):
            assert torch.equal(ckpt.read([name], expected[name].shape, start, end), flat[start:end]), (name, start, end)

    loss = engine.forward_loss(batch)
    engine.backward(loss, last_micro=True)
    engine.step()
    assert torch.isfinite(loss)
    experts = model.get_parameter(stacked[0])
    assert not torch.equal(experts.detach(), expected[stacked[0]])  # the experts trained

    path = CheckpointManager(cfg, strategy, info, engine).save(1)
    out = export_hf(path, str(tmp_path / "hf"))
    assert _keys(out) == keys  # the layout it was read from: per expert, or gpt-oss's stacked
    back = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(_logits(back, batch), _logits(model, batch))


def test_a_chain_that_cannot_be_cut_by_expert_is_converted_whole(moe_dirs, monkeypatch):
    """A converter whose operations do not stack by rows is run on all its checkpoint tensors
    once, and each range cut from the result (the same tensors)."""
    monkeypatch.setattr(harness.models.conversions, "_stacks_by_rows", lambda *a: False)
    directory = moe_dirs["mixtral"]
    reference = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    template = empty_model(model_config(directory))
    ckpt = CheckpointWeights(directory, template.base_model_prefix)
    ckpt.follow_conversions(template)
    ckpt.check_shapes(template)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        flat = reference[name].reshape(-1)
        assert torch.equal(ckpt.read([name], reference[name].shape, 11, 5000), flat[11:5000]), name


def test_an_expert_count_other_than_the_configs_is_one_line_exit_2_nothing_written(moe_dirs, tmp_path, monkeypatch, capfd):
    from launching import call_entry_point, env

    import harness.train

    directory = tmp_path / "mixtral"
    directory.mkdir()
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        src = f"{moe_dirs['mixtral']}/{name}"
        (directory / name).write_bytes(open(src, "rb").read())
    config = json.loads((directory / "config.json").read_text())
    config["num_local_experts"] = 6  # the checkpoint holds 4
    (directory / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    argv = [f"model.name={directory}", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}", "data.seq_len=32"]
    code, err, _ = call_entry_point(harness.train.main, argv, env(), monkeypatch, capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "holds 4 checkpoint tensors" in lines[0] and "config.json makes 6" in lines[0], lines
    assert "model.layers.0.mlp.experts." in lines[0], lines
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_data_whose_vocabulary_the_checkpoint_does_not_embed_is_one_line_exit_2(moe_dirs, tmp_path, monkeypatch, capfd):
    """The embedded corpus at its default vocabulary on a checkpoint that embeds 512 tokens (these
    tiny families, saved without a tokenizer): one line naming both sizes, before the first forward's
    IndexError on every rank."""
    from launching import call_entry_point, env

    import harness.train

    argv = [f"model.name={moe_dirs['qwen3_moe']}", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}"]
    argv += ["data.seq_len=32", "data.max_tokens=20000", "logging.wandb=false"]
    code, err, _ = call_entry_point(harness.train.main, argv, env(), monkeypatch, capfd)
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("harness: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert f"model.name '{moe_dirs['qwen3_moe']}' embeds 512" in lines[0] and "data.vocab_size <= 512" in lines[0], lines
