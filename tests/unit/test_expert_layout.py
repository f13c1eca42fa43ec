"""Expert parallelism's layout and refusals, in one process (the 2-rank run against one process:
tests/integration/test_expert_parallel.py).

The layout: experts carved out of the data-parallel ranks (the data world, global batch and
sequence arithmetic unchanged), rank r holding expert range r % N, ranks N apart holding the same
experts; every setting it does not support refused in one line before any process group.
"""

from __future__ import annotations

import pytest
from model_families import moe_configs
from transformers import AutoModelForCausalLM

from harness.config import ConfigError, ParallelLayout, check_run, load_config, load_strategy
from harness.models import empty_model, expert_count, expert_parallel_problem, expert_tensors, preset_config
from harness.runner.preflight import check_experts


def test_experts_are_carved_out_of_the_data_ranks():
    layout = ParallelLayout(world=4, expert=2)
    assert layout.data == 4 and layout.global_batch(2, 3) == 24  # every rank still reads its own samples
    assert [layout.data_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert [layout.expert_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert layout.expert_replicas == 2
    assert [layout.expert_replica_ranks(r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [list(layout.experts_of(r, 8)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.splits_experts and not layout.splits_sequences
    assert layout.describe() == "experts split over 2 ranks"
    whole = ParallelLayout(world=2, expert=2)  # expert = world: no replicas, expert gradients reduced nowhere
    assert whole.expert_replicas == 1 and whole.expert_replica_ranks(1) == [1]
    assert not ParallelLayout(world=2).splits_experts
    both = ParallelLayout(world=4, sequence=2, expert=2)  # sequence groups {0,1} {2,3}; expert ranges over the world
    assert both.data == 2 and [both.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [both.expert_rank(r) for r in range(4)] == [0, 1, 0, 1] and both.expert_replica_ranks(0) == [0, 2]
    assert both.describe() == "each sequence split over 2 ranks, experts split over 2 ranks"


@pytest.mark.parametrize(
    ("world", "expert", "sequence", "message"),
    [
        (2, 3, 1, r"parallel.expert=3 must divide the world size \(2\)"),
        (4, 0, 1, r"parallel.expert=0 must divide"),
        (6, 4, 2, r"parallel.expert=4 must divide the world size \(6\)"),
    ],
)
def test_a_layout_the_experts_cannot_take_is_refused(world, expert, sequence, message):
    with pytest.raises(ConfigError, match=message):
        ParallelLayout(world=world, sequence=sequence, expert=expert)


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        (["strategy=zero2"], "strategy=zero2 (deepspeed)"),
        (["strategy=zero3"], "strategy=zero3 (deepspeed)"),
        (["prune.method=magnitude"], "prune.method=magnitude"),
        (["lora.enabled=true"], "lora.enabled"),
        (["precision=fp16"], "precision=fp16"),
    ],
)
def test_what_expert_parallelism_does_not_run_with_is_one_line(overrides, setting):
    cfg = load_config(None, ["strategy=ddp", "parallel.expert=2", *overrides])
    with pytest.raises(ConfigError) as err:
        check_run(cfg, load_strategy(cfg.strategy, env={}), 2, False)
    assert str(err.value).startswith(f"parallel.expert=2 with {setting}: expert parallelism runs under strategy=ddp or fsdp"), err.value
    assert "\n" not in str(err.value)


def test_fsdp2_splits_experts_in_fp32_and_in_mixed_bf16():
    """Each expert range is its own FSDP2 group on the replica mesh, cast by the same mixed precision
    as the rest (the bf16 run measured in test_planner_moe.py, judged by --check in test_check.py)."""
    for precision in ("fp32", "bf16"):
        cfg = load_config(None, ["strategy=fsdp", "parallel.expert=2", f"precision={precision}"])
        check_run(cfg, load_strategy(cfg.strategy, env={}), 2, False)


def test_the_experts_come_from_transformers_plan_and_must_divide_by_n():
    for name, config in moe_configs(experts=6).items():
        model = empty_model(config)
        assert expert_count(model) == 6, name
        tensors = expert_tensors(model)  # two stacked projections a layer (gpt-oss: and their biases)
        assert all(p.shape[0] == 6 for p in tensors.values()) and len(tensors) == (8 if name == "gpt_oss" else 4), name
        assert expert_parallel_problem(model, 2) is None and expert_parallel_problem(model, 3) is None
        assert expert_parallel_problem(model, 4) == (
            "parallel.expert=4 must divide the model's 6 experts per layer: each rank holds an equal share"
        )
    dense = AutoModelForCausalLM.from_config(preset_config("tiny-llama", vocab_size=64))
    assert "LlamaForCausalLM has no expert plan in transformers" in expert_parallel_problem(dense, 2)


def test_preflight_refuses_a_model_without_experts():
    cfg = load_config(None, ["model.name=tiny-llama", "parallel.expert=2"])
    with pytest.raises(ConfigError, match=r"model.name 'tiny-llama': parallel.expert=2: LlamaForCausalLM has no expert plan"):
        check_experts(cfg, ParallelLayout(world=2, expert=2))
    check_experts(load_config(None, ["model.name=tiny-llama"]), ParallelLayout(world=2))  # nothing split: nothing asked


def test_a_split_that_would_split_nothing_is_refused_not_run():
    """peft's adapters rename the experts' parameters (`...experts.base_layer.gate_up_proj`), so
    transformers' expert plan names none of them: applied, every rank would keep every expert while
    the run says they are split (found with LoRA's refusal lifted by hand). `split_experts` refuses
    before any mesh is touched."""
    import peft

    from harness.models import split_experts

    model = empty_model(moe_configs(experts=4)["qwen3_moe"])
    assert expert_tensors(model)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    wrapped = peft.get_peft_model(model, lora)
    assert wrapped.base_model.model.ep_plan  # the plan is there; its names are not the wrapped model's
    with pytest.raises(ValueError, match=r"its expert plan names none of its parameters .* no expert would be split"):
        split_experts(wrapped, None, None)  # type: ignore[arg-type]
