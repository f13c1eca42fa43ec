"""The router's load-balancing loss (`harness.training.router`), in process, on tiny random models of
four mixture-of-experts families built from transformers' config classes (no checkpoint: this
branch's loader reads gpt-oss's fused experts, not the per-expert files of the other three).

- on by default with the model config's coefficient, and the loss, its gradient and the logged aux
  loss equal transformers' own (`output_router_logits=True`, labels given) on the same batch, plain
  and chunked;
- 0 switches it off (the language-model loss alone, still logged); a frozen router (LoRA's base)
  leaves auto off; a number overrides the config's;
- a coefficient written for a dense model or a family whose loss transformers does not expose is
  refused in one line; auto says so instead;
- `moe.aux_loss_coef` values are checked when the config is read;
- told which tokens the run routed (`routed_tokens`: the check's reference, whose rows hold packed
  examples one to a row, padded), the loss, its gradient and the recorded expert counts are those
  of those tokens alone.

Split-invariance through the user's entry point (world 2 x accum 1 = world 1 x accum 2):
tests/integration/test_moe_router_runs.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen3MoeConfig,
)

from harness.config import load_config
from harness.errors import ConfigError
from harness.training import RouterLoss, causal_lm_loss

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "gpt_oss": lambda: GptOssConfig(num_local_experts=4, num_experts_per_tok=2, head_dim=8, layer_types=["full_attention"] * 2, **SMALL),
    "qwen3_moe": lambda: Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, **SMALL),
    "mixtral": lambda: MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **SMALL),
    "olmoe": lambda: OlmoeConfig(num_experts=4, num_experts_per_tok=2, **SMALL),
}


def tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[family]()).float()


def batch() -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


def router_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and ("router" in n or ".gate." in n)}
    model.zero_grad(set_to_none=True)
    assert out
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_on_by_default_with_the_config_coefficient_and_equal_to_transformers(family):
    model, ids = tiny(family), batch()
    coef = model.config.router_aux_loss_coef
    assert coef > 0 and not model.config.output_router_logits  # transformers' default drops the loss
    hf = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    hf.loss.backward()
    hf_grads = router_grads(model)
    hf_loss, hf_aux = float(hf.loss.detach()), float(hf.aux_loss.detach())
    router = RouterLoss(None)  # moe.aux_loss_coef=auto
    said = router.attach(model)
    assert router.active and router.coef == coef
    assert said.startswith(f"router aux loss x{coef:g} (the model config's router_aux_loss_coef") and "top-2" in said
    for chunk in (0, 8):  # plain, and the chunked loss (router logits returned from inside the forward)
        loss = causal_lm_loss(model, ids, chunk_size=chunk, router=router)
        assert float(loss.detach()) == pytest.approx(hf_loss, rel=1e-6)
        loss.backward()
        for name, grad in router_grads(model).items():
            torch.testing.assert_close(grad, hf_grads[name], rtol=1e-5, atol=1e-7)
        recorded = router.pop()
        assert float(recorded[0]) == pytest.approx(hf_aux, rel=1e-6)
        counts = recorded[1:].reshape(2, 4)
        assert counts.sum(dim=1).tolist() == [ids.numel() * 2] * 2  # every token's top-2 choices, per layer
    with torch.no_grad():  # evaluation: no router logits asked for, nothing recorded
        assert float(causal_lm_loss(model, ids, router=router)) == pytest.approx(hf_loss - coef * hf_aux, rel=1e-6)
    assert router.pop() is None


def test_zero_switches_it_off_a_number_overrides_and_a_frozen_router_leaves_auto_off():
    model, ids = tiny("gpt_oss"), batch()
    plain = float(causal_lm_loss(model, ids).detach())  # the language-model loss alone
    off = RouterLoss(0.0)
    assert off.attach(model).startswith("router aux loss off (moe.aux_loss_coef=0; logged, not added)")
    assert float(causal_lm_loss(model, ids, router=off).detach()) == plain
    aux = float(model(input_ids=ids, output_router_logits=True, use_cache=False).aux_loss.detach())
    assert float(off.pop()[0]) == pytest.approx(aux, rel=1e-6)  # still logged
    louder = RouterLoss(0.5)
    assert "x0.5 (moe.aux_loss_coef; the model config's 0.001)" in louder.attach(model)
    assert float(causal_lm_loss(model, ids, router=louder).detach()) == pytest.approx(plain + 0.5 * aux, rel=1e-6)
    for name, p in model.named_parameters():  # a frozen base: the routers do not train
        p.requires_grad_("router" not in name)
    frozen = RouterLoss(None)
    assert frozen.attach(model).startswith("router aux loss off (the routers do not train")
    assert frozen.coef == 0.0 and frozen.active


def test_expert_load_is_max_over_mean_tokens_per_expert():
    router = RouterLoss(None)
    router.layers, router.num_experts = [0, 3], 4
    summed = (6.0, 1.0, 1.0, 1.0, 1.0, 4.0, 0.0, 0.0, 0.0)  # aux over 3 micro-batches; layer 0 balanced, layer 3 on one expert
    assert router.step_metrics(summed, 3) == {"train/aux_loss": 2.0, "moe/expert_load/layer_0": 1.0, "moe/expert_load/layer_3": 4.0}


def test_a_coefficient_is_refused_where_there_is_no_loss_and_auto_says_why():
    dense = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL))
    assert RouterLoss(None).attach(dense) is None  # nothing to say for a dense model
    with pytest.raises(ConfigError, match=r"moe.aux_loss_coef=0.01 but LlamaForCausalLM has no mixture-of-experts router"):
        RouterLoss(0.01).attach(dense)
    deepseek = AutoModelForCausalLM.from_config(
        DeepseekV3Config(
            **{**SMALL, "num_key_value_heads": 4},
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    )
    with pytest.raises(ConfigError, match=r"defines no load_balancing_loss_func for DeepseekV3ForCausalLM's router; unset it"):
        RouterLoss(0.01).attach(deepseek)
    auto = RouterLoss(None)
    assert auto.attach(deepseek).startswith("no router aux loss (") and not auto.active
    assert RouterLoss(0.0).attach(deepseek).startswith("no router aux loss (")  # 0 asks for nothing: no refusal


@pytest.mark.parametrize("value", ["x", "-0.1", "nan"])
def test_bad_coefficients_are_refused_when_the_config_is_read(value):
    with pytest.raises(ConfigError, match=r"moe.aux_loss_coef=.* must be auto"):
        load_config(None, [f"moe.aux_loss_coef={value}"])
    assert load_config(None, ["moe.aux_loss_coef=1e-2"]).moe.aux_loss_coef == "1e-2"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_tokens_the_run_never_routed_are_left_out_of_the_balance(family):
    """`--check`'s reference holds each packed example in a row of its own, padded: the router is told
    which tokens the run routed, and its loss, gradients and expert counts are those of those tokens
    alone (here the first 12 of each row's 16, picked out of the same forward's logits)."""
    model, ids = tiny(family), torch.randint(0, SMALL["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(2))
    router = RouterLoss(1.0)  # a large coefficient: the aux term's gradient is not lost under the LM's
    router.attach(model)
    out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    expected = router([g.view(4, 16, -1)[:, :12].reshape(-1, g.shape[-1]) for g in out.router_logits])
    counts = router.pop()[1:]
    expected.backward()
    want = router_grads(model)
    model.zero_grad()
    router.routed_tokens.append(torch.arange(16).expand(4, 16) < 12)
    got = router(model(input_ids=ids, output_router_logits=True, use_cache=False).router_logits)
    assert float(got.detach()) == pytest.approx(float(expected), rel=1e-6)
    got.backward()
    for name, grad in router_grads(model).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-8)
    recorded = router.pop()
    assert float(recorded[0]) == pytest.approx(float(expected), rel=1e-6) and torch.equal(recorded[1:], counts)
    everything = router(model(input_ids=ids, output_router_logits=True, use_cache=False).router_logits)
    assert abs(float(everything) - float(expected)) > 1e-4  # the padding's routing would move it
