"""Expert pruning (`harness.pruning.experts`) on tiny random models of four MoE families.

- the masked model (routers routing as the smaller model's) and the exported smaller model
  (`drop_experts`, saved by `save_pretrained`, read back by `from_pretrained`) give the same
  logits, for Qwen3-MoE, Mixtral, OLMoE, gpt-oss, Qwen2-MoE (a shared expert) and DeepSeek-V3
  (group-limited routing); and the mask changes the logits; a router that cannot route over fewer
  experts (Ernie 4.5's) is refused in one line;
- REAP's score equals a hand computation from the router's probabilities and the stacked expert
  weights (Qwen3-MoE);
- the gradient score equals the sum of (w <dL/dy, f_e(x)>)^2 over each expert's routed pairs, dL/dy
  from the block output's gradient and f_e from the stacked weights;
- pre-flight's one-line refusals: too few experts left to route, none dropped, a dense model, fine-tuning
  before the export, a fraction out of range, with expert parallelism.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from model_families import moe_configs
from transformers import AutoModelForCausalLM

from harness.config import ConfigError, ParallelLayout, PruneConfig, check_run, load_config, load_strategy
from harness.models import EXPERT_COUNT_ATTRS, drop_experts
from harness.pruning.experts import ExpertScores, RouterMask, choose, drop_count, moe_layers
from harness.runner.preflight import check_experts

EXPERTS = 8


SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512, max_position_embeddings=64, num_experts_per_tok=2)
OTHERS = {  # families beyond the four: a shared expert beside the routed ones; DeepSeek's group-limited sigmoid router
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        num_experts=EXPERTS, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_key_value_heads=2, **SMALL
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        n_routed_experts=EXPERTS,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=0,
        moe_intermediate_size=32,
        num_key_value_heads=4,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        kv_lora_rank=16,
        q_lora_rank=None,
        head_dim=8,
        **SMALL,
    ),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(num_experts=EXPERTS, moe_intermediate_size=32, **SMALL),
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = OTHERS[family]() if family in OTHERS else moe_configs(EXPERTS)[family]
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a router that is not uniform: some experts win more tokens
        for layer in moe_layers(model):
            layer.router.weight.mul_(20.0)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen2_moe", "deepseek_v3"])
def test_masked_model_equals_the_exported_smaller_model(family: str, tmp_path) -> None:
    model = _model(family)
    layers = moe_layers(model)
    assert [layer.count for layer in layers] == [EXPERTS] * 2
    scores = torch.rand(len(layers), EXPERTS, generator=torch.Generator().manual_seed(2))
    kept = choose(scores, drop=2 if family == "deepseek_v3" else 3)  # DeepSeek: a count its 2 groups divide
    ids = _ids()
    with torch.no_grad():
        dense = model(ids).logits
        mask = RouterMask(layers, kept)
        masked = model(ids).logits
        mask.remove()
    assert (masked - dense).abs().max() > 1e-3  # the dropped experts carried tokens
    smaller = copy.deepcopy(model)
    left = len(kept[0])
    assert drop_experts(smaller, {layer.block: k for layer, k in zip(layers, kept)}) == left
    smaller.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert next(getattr(loaded.config, a) for a in EXPERT_COUNT_ATTRS if hasattr(loaded.config, a)) == left
    router = moe_layers(loaded)[0].router
    assert router.weight.shape[0] == left
    torch.testing.assert_close(router.weight, moe_layers(model)[0].router.weight[kept[0]])
    with torch.no_grad():
        exported = loaded(ids).logits
    torch.testing.assert_close(exported, masked, rtol=1e-5, atol=1e-5)


def _scores(model: torch.nn.Module, rule: str, backward: bool = False) -> torch.Tensor:
    layers = moe_layers(model)
    with ExpertScores(layers, rule) as scores:
        with torch.set_grad_enabled(backward):
            out = model(_ids(), labels=_ids())
        if backward:
            out.loss.backward()
    return scores


def _routed_outputs(block: torch.nn.Module, x: torch.Tensor, index: torch.Tensor):
    """(token, slot, expert, that expert's output for the token) of every routed pair, from Qwen3-MoE's
    stacked weights by hand (SwiGLU: down(silu(gate) * up))."""
    e = block.experts
    for t in range(index.shape[0]):
        for k in range(index.shape[1]):
            j = int(index[t, k])
            gate, up = (e.gate_up_proj[j] @ x[t]).chunk(2)
            yield t, k, j, e.down_proj[j] @ (torch.nn.functional.silu(gate) * up)


def test_reap_score_is_the_mean_routed_weight_times_output_norm() -> None:
    model = _model("qwen3_moe")
    scores = _scores(model, "reap")
    block = model.model.layers[0].mlp
    seen: dict[str, torch.Tensor] = {}
    block.register_forward_pre_hook(lambda m, args: seen.update(x=args[0].reshape(-1, 64)))
    with torch.no_grad():
        model(_ids())
        logits, _, index = block.gate(seen["x"])
        weight = torch.softmax(logits.double(), dim=-1).gather(1, index)  # the router's probability (REAP's authors' code)
        value, count = torch.zeros(EXPERTS, dtype=torch.float64), torch.zeros(EXPERTS, dtype=torch.float64)
        for t, k, j, out in _routed_outputs(block, seen["x"], index):
            value[j] += float(weight[t, k]) * out.double().norm()
            count[j] += 1
    torch.testing.assert_close(scores.count[0], count)
    reap = scores.totals(_NoComm(), seed=0)[0]
    torch.testing.assert_close(reap, torch.where(count > 0, value / count.clamp(min=1), 0.0), rtol=1e-5, atol=1e-9)
    assert count.min() < count.max()  # the routing is not uniform: the test can tell experts apart


def test_gradient_score_is_the_squared_first_order_change_of_each_routed_term() -> None:
    """dL/dw of a (token, slot) is <dL/dy, f_k(x)>: computed here from the block output's gradient
    and the expert's output from its stacked weights, not from the routing weights' gradient."""
    model = _model("qwen3_moe")
    block = model.model.layers[0].mlp
    seen: dict[str, torch.Tensor] = {}
    block.register_forward_pre_hook(lambda m, args: seen.update(x=args[0].reshape(-1, 64)))

    def keep_output(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.retain_grad()
        seen["y"] = out

    block.register_forward_hook(keep_output)
    scores = _scores(model, "gradient", backward=True)
    dy = seen["y"].grad.reshape(-1, 64)
    with torch.no_grad():
        _, weight, index = block.gate(seen["x"])
        expected = torch.zeros(EXPERTS, dtype=torch.float64)
        for t, k, j, out in _routed_outputs(block, seen["x"], index):
            expected[j] += (float(weight[t, k]) * (dy[t].double() @ out.double())) ** 2
    torch.testing.assert_close(scores.totals(_NoComm(), seed=0)[0], expected, rtol=1e-4, atol=1e-15)
    assert expected.min() > 0


def test_a_router_that_cannot_route_over_fewer_experts_is_refused_in_one_line() -> None:
    """Ernie 4.5's router adds a per-expert bias held by a module of its own, which the smaller model's
    router would not slice: said before anything is scored, not a shape error mid-forward."""
    model = _model("ernie4_5_moe")
    layers = moe_layers(model)
    mask = RouterMask(layers, [list(range(6))] * len(layers))
    with pytest.raises(ConfigError, match=r"^prune.experts: Ernie4_5_MoeTopKRouter cannot route over 6 of its 8 experts \(RuntimeError"):
        with torch.no_grad():
            model(_ids())
    mask.remove()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["prune.experts=0.9"],
            r"prune.experts=0.9 keeps 1 of 8 experts per layer, fewer than the model routes each token to \(2\); set it to at most 0.75",
        ),
        (["prune.experts=0.1"], r"prune.experts=0.1 drops none of 8 experts per layer; set it to at least 0.125"),
        (["prune.experts=0.25", "model.name=tiny-llama"], r"prune.experts=0.25: LlamaForCausalLM has no mixture-of-experts layers"),
        (
            ["prune.experts=0.25", "prune.finetune_steps=2"],
            r"fine-tune the exported model .* python -m harness.train model.name=<output_dir>/hf",
        ),
        (["prune.experts=1.5"], r"prune.experts=1.5 \(the fraction of each MoE layer's experts to drop\) must be in \[0, 1\)"),
        (
            ["prune.experts=0.25", "strategy=ddp", "parallel.expert=2"],
            r"parallel.expert=2 with prune.experts=0.25: expert parallelism runs",
        ),
    ],
)
def test_preflight_refuses_in_one_line(tmp_path, overrides: list[str], message: str) -> None:
    moe_configs(EXPERTS)["qwen3_moe"].save_pretrained(tmp_path)  # the config alone: checks build the meta model
    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, [f"model.name={tmp_path}", *overrides])
        check_run(cfg, load_strategy(cfg.strategy), world=2 if "parallel.expert=2" in overrides else 1, has_accelerator=False)
        check_experts(cfg, ParallelLayout.of(cfg.parallel, 1))
    assert drop_count(PruneConfig(experts=0.5), 8, 2) == 4


def test_experts_whose_router_transformers_does_not_record_are_named(tmp_path) -> None:
    """Llama 4 has experts, but its router is not among the outputs transformers records: the refusal
    says so, not that the model has no mixture-of-experts layers."""
    from transformers import AutoConfig

    small = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, vocab_size=512, intermediate_size=64)
    AutoConfig.for_model("llama4_text", **small, intermediate_size_mlp=64, num_local_experts=4).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.name={tmp_path}", "prune.experts=0.5"])
    with pytest.raises(ConfigError, match=r"Llama4ForCausalLM's routers are not among the outputs transformers records \(router_logits\)"):
        check_experts(cfg, ParallelLayout.of(cfg.parallel, 1))


class _NoComm:
    """One process: sums are the values."""

    world = 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t
