"""LoRA on mixture-of-experts models reaches the experts, at world 1 in one process.

transformers 5 holds a MoE layer's experts as stacked tensors (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), which no linear-layer name reaches: with `lora.target_modules` alone
the adapters would sit on attention and the experts would stay frozen (the 13.5 MB adapter where
3.7 GB was meant). Unset, `lora.target_parameters` is filled with them (peft's
`target_parameters`: one rank-r pair per expert). Here, per family: the run's model is the one a
hand-written peft script builds from `from_pretrained` with the same targets named explicitly
(the same adapter names, loss and adapter gradients), the base stays what was loaded, and the
exported adapter directory holds exactly the adapter elements its targets imply and loads in
peft with the run's logits. Under FSDP2 at world 2 the same run was compared by hand (notes/moe.md);
DeepSpeed, QLoRA and dropout on stacked experts are refused in one line.
"""

from __future__ import annotations

import functools

import peft
import pytest
import torch
from model_families import save_moe_families
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from harness.checkpoint import CheckpointManager, export_hf
from harness.config import load_config, load_strategy
from harness.distributed import DistInfo
from harness.engine import build_engine, plan_engine
from harness.errors import ConfigError
from harness.models import empty_model, model_config, model_spec, resolve_targets, stacked_expert_parameters
from harness.training import causal_lm_loss

R, ALPHA = 4, 16
ATTENTION = ["k_proj", "o_proj", "q_proj", "v_proj"]
EXPERTS = ["experts.down_proj", "experts.gate_up_proj"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return save_moe_families(tmp_path_factory.mktemp("moe-lora"), ("qwen3_moe", "mixtral", "gpt_oss"))


def _engine(directory: str, out, *overrides: str):
    cfg = load_config(
        None, [f"model.name={directory}", f"output_dir={out}", "precision=fp32", "lora.enabled=true", f"lora.r={R}", *overrides]
    )
    strategy = load_strategy("ddp")
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    plan = plan_engine(cfg, strategy, 1, info.device, None)
    return cfg, strategy, info, build_engine(model_spec(directory), cfg, plan, info, functools.partial(causal_lm_loss, chunk_size=0))


def _adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_experts_are_adapted_as_a_hand_written_peft_script_adapts_them(moe_dirs, family, tmp_path):
    directory = moe_dirs[family]
    cfg, strategy, info, engine = _engine(directory, tmp_path / "run")
    model = engine.module
    loaded = AutoModelForCausalLM.from_pretrained(directory)
    script = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(directory),
        peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=ATTENTION, target_parameters=EXPERTS),
    ).base_model.model
    ours, theirs = _adapters(model), _adapters(script)
    assert ours.keys() == theirs.keys()
    assert sum(".experts." in n for n in ours) == 2 * 2 * 2  # A and B of both stacked tensors in both layers
    with torch.no_grad():  # the same start, lora_B away from zero so every adapter has a gradient
        generator = torch.Generator().manual_seed(1)
        for name, p in ours.items():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
            theirs[name].copy_(p)
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = engine.forward_loss(batch)
    engine.backward(loss, last_micro=True)
    expected = script(batch, labels=batch).loss
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-6, atol=0)
    for name, p in ours.items():
        scale = float(theirs[name].grad.abs().max())  # fp32 sums in another order: small entries differ at 1e-8
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}")
    engine.step()
    frozen = {n: t for n, t in model.state_dict().items() if ".lora_" not in n}
    base = loaded.state_dict()
    for name, tensor in frozen.items():  # the experts, the routers and the rest: as loaded
        clean = name.replace(".base_layer", "")
        assert torch.equal(tensor, base[clean]), name
    stepped = [n for n in ours if not torch.equal(ours[n].detach(), theirs[n].detach())]
    assert stepped == list(ours)  # every adapter trained, the experts' included

    path = CheckpointManager(cfg, strategy, info, engine).save(1)
    out = export_hf(path, str(tmp_path / "adapter"))
    with safe_open(f"{out}/adapter_model.safetensors", "pt") as f:
        elements = sum(f.get_tensor(k).numel() for k in f.keys())
    claimed = 0
    for name, p in loaded.named_parameters():
        leaf = ".".join(name.split(".")[-2:])
        if leaf in EXPERTS:
            experts, a, b = p.shape
            claimed += R * experts * (a + b)
        elif name.endswith(".weight") and name.split(".")[-2] in ATTENTION:
            out_features, in_features = p.shape
            claimed += R * (in_features + out_features)
    assert elements == claimed == sum(p.numel() for p in ours.values())
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), out).eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(batch).logits, model(batch).logits, rtol=1e-5, atol=1e-6)


def test_what_the_adapters_reach_is_the_users_or_refused_in_one_line(moe_dirs):
    template = empty_model(model_config(moe_dirs["qwen3_moe"]))
    assert stacked_expert_parameters(template) == EXPERTS

    def targets(*overrides: str):
        return resolve_targets(template, load_config(None, ["lora.enabled=true", *overrides]).lora, quiet=True)

    assert (targets().modules, targets().parameters) == (ATTENTION, EXPERTS)
    assert targets("lora.target_parameters=[]").parameters == []  # attention only, experts frozen
    assert targets("lora.target_parameters=[mlp.experts.down_proj]").parameters == ["mlp.experts.down_proj"]
    for override, message in (
        ("lora.target_parameters=[experts.w9]", "does not have"),
        ("lora.dropout=0.1", "lora.dropout=0.1 cannot apply to stacked experts"),
        ("lora.quantize=nf4", "bitsandbytes quantizes linear layers only"),
    ):
        with pytest.raises(ConfigError, match=message):
            targets(override)


def test_deepspeed_with_expert_adapters_is_one_line_exit_2_nothing_written(moe_dirs, tmp_path, monkeypatch, capfd):
    from launching import call_entry_point, env

    import harness.train

    out = tmp_path / "out"
    argv = [f"model.name={moe_dirs['qwen3_moe']}", "lora.enabled=true", "strategy=zero3", f"output_dir={out}", "data.seq_len=32"]
    code, err, _ = call_entry_point(harness.train.main, argv, env(), monkeypatch, capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "not DeepSpeed" in lines[0], err
    assert not out.exists()
