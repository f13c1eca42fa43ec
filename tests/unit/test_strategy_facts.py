"""Decisions read the resolved strategy (engine, ZeRO stage, offload), never its name.

The same strategy arrives three ways: a shipped name (`zero2_offload`), a user's own DeepSpeed
file (`my_ds.json`), or no `strategy:` at all under `accelerate launch --use_deepspeed`. The
planner's offload time, its step-time ranking, the memory ladder and the OOM advice must give
each the same answer.
"""

from __future__ import annotations

import json

import pytest

from harness.config import (
    StrategyFacts,
    facts_of,
    load_config,
    load_strategy,
    more_sharding,
    shipped_equivalent,
    shipped_facts,
    shipped_names,
)
from harness.planner.candidates import SPEED, Candidate
from harness.planner.ladder import offload_seconds, relative_time, rung_overrides
from harness.planner.recommend import explain
from harness.reliability import oom

TINY = ["model.name=tiny-llama", "data.seq_len=64", "micro_batch_size=2"]
DEEPSPEED_ZERO2 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}


@pytest.fixture
def my_ds(tmp_path) -> str:
    """A user's own DeepSpeed file: ZeRO-2 with the optimizer offloaded to the CPU."""
    path = tmp_path / "my_ds.json"
    path.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    )
    return str(path)


@pytest.fixture
def launched_with_deepspeed(monkeypatch) -> None:
    """This process as `accelerate launch --use_deepspeed --zero_stage 2` starts a rank: no strategy named."""
    for key in ("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(key, raising=False)
    for key, value in DEEPSPEED_ZERO2.items():
        monkeypatch.setenv(key, value)


def test_every_shipped_strategy_has_facts_of_its_own() -> None:
    for name in shipped_names():
        assert shipped_equivalent(facts_of(name)) == name


def test_a_users_deepspeed_file_with_cpu_offload_is_costed_with_offload(my_ds: str) -> None:
    """Offload time and step time follow the file's offload block, as for the shipped zero2_offload."""
    own = load_config(None, [*TINY, f"strategy={my_ds}"])
    shipped = load_config(None, [*TINY, "strategy=zero2_offload"])
    params = 10**9
    assert offload_seconds(own, params, 2) == offload_seconds(shipped, params, 2) > 0
    assert relative_time(own) == relative_time(shipped) > relative_time(load_config(None, [*TINY, "strategy=zero2"]))
    assert shipped_equivalent(facts_of(my_ds)) == "zero2_offload"


def test_offload_time_follows_what_is_offloaded_not_the_name() -> None:
    """ZeRO-3 with parameters on the host moves them twice a step more than the optimizer alone; the
    NVMe strategy offloads too (its name does not end in "offload")."""
    params = 10**9
    cost = {name: offload_seconds(load_config(None, [*TINY, f"strategy={name}"]), params, 2) for name in shipped_names()}
    assert {n for n, s in cost.items() if s > 0} == {"zero2_offload", "zero3_offload", "zero3_nvme", "fsdp_offload"}
    assert cost["zero3_offload"] > cost["zero2_offload"]


def test_a_deepspeed_rank_without_strategy_is_advised_its_next_zero_stage(launched_with_deepspeed, monkeypatch) -> None:
    """The OOM advice costs every change under the run's DeepSpeed strategy, and "more sharding" is
    ZeRO-3, never a switch to FSDP2 (which the advice offered a DDP run, as it took this one for)."""
    cfg = load_config(None, TINY)
    assert cfg.strategy is None
    costed = []

    class Peak:
        total = 10**12

    def fake_estimate(variant, world, *, target, strategy=None):
        costed.append((variant.strategy, strategy))
        return Peak()

    monkeypatch.setattr(oom, "estimate", fake_estimate)
    advice = oom.planner_suggestion(cfg, 2, 10**6, "cpu")
    assert "no single change fits" in advice
    assert all(s is not None and s.kind == "deepspeed" for _, s in costed)
    changed = [name for name, _ in costed if name is not None]
    assert changed == ["zero3"] and costed[[n for n, _ in costed].index("zero3")][1].zero_stage == 3


def test_the_ladder_and_the_recommender_continue_the_runs_own_engine(launched_with_deepspeed) -> None:
    """--recommend: the sharding rung of a DeepSpeed run is its next ZeRO stage; its step time is
    ZeRO-2's; the recommender sees the user's strategy as zero2, not as a DDP to move from."""
    strategy = load_strategy(None)
    rungs = {rung.name: overrides for rung, overrides in rung_overrides(2, strategy=strategy)}
    sharding = next(o for name, o in rungs.items() if name.startswith("more sharding"))
    assert "strategy=zero3" in sharding and "strategy=fsdp" not in sharding
    cfg = load_config(None, TINY)
    assert relative_time(cfg) == relative_time(load_config(None, [*TINY, "strategy=zero2"]))  # the same strategy, named
    assert relative_time(cfg) == pytest.approx(SPEED["precision"][cfg.precision] * shipped_facts("zero2").step_time)
    assert shipped_facts("zero2").step_time != shipped_facts("ddp").step_time
    as_configured = Candidate(cfg.precision, cfg.memory.activation_checkpointing, cfg.micro_batch_size, cfg.grad_accum, "zero2")
    assert explain(cfg, as_configured, lambda c: pytest.fail(f"nothing to undo, asked {c}")) == []


def test_nothing_shards_further_than_zero3_offload_or_fsdp2() -> None:
    assert more_sharding(facts_of("zero3_offload")) is None and more_sharding(facts_of("fsdp")) is None
    assert more_sharding(StrategyFacts("ddp", 0)) == "fsdp" and more_sharding(facts_of("zero2_offload")) == "zero3_offload"
    assert [rung.name for rung, _ in rung_overrides(2, strategy=load_strategy("fsdp"))] == [
        rung.name for rung, _ in rung_overrides(2) if not rung.name.startswith("more sharding")
    ]


def test_launcher_flags_and_the_planners_search_name_shipped_strategies_by_their_facts() -> None:
    """`accelerate launch` flags name the shipped strategy with the same facts (offload devices but
    NVMe: those are laid on the stage's own file), and the planner's search is every shipped strategy
    that means something at the world size, so a new shipped file needs no list edited. Milliseconds."""
    from harness.config.strategies import strategy_from_launcher
    from harness.planner.candidates import strategies_for

    for name in shipped_names():
        facts = shipped_facts(name)
        if facts.kind != "deepspeed" or "nvme" in (facts.offload_optimizer, facts.offload_params):
            continue
        env = {
            "ACCELERATE_USE_DEEPSPEED": "true",
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(facts.stage),
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": facts.offload_optimizer,
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": facts.offload_params,
        }
        assert strategy_from_launcher(env) == name
    assert strategies_for(2, True, "cuda") == shipped_names()
    assert "zero3_nvme" not in strategies_for(2, False, "cuda")
    assert all(shipped_facts(s).kind == "ddp" or shipped_facts(s).offloads_optimizer for s in strategies_for(1, False, "cuda"))
