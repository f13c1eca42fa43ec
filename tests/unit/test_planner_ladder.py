"""The memory ladder: every rung a valid config here, walked in order, the first that fits chosen."""

from __future__ import annotations

import pytest

from harness.config import check_run, load_config, load_strategy
from harness.planner.ladder import RUNGS, first_fit, offload_seconds, rung_overrides, walk_ladder

TINY = ["model.name=tiny-llama", "data.seq_len=64", "micro_batch_size=2"]


@pytest.mark.parametrize("world", [1, 2])
def test_every_rung_is_a_config_the_trainer_accepts(world: int) -> None:
    rungs = rung_overrides(world)
    assert [r.name for r, _ in rungs] == [r.name for r in RUNGS if world >= r.min_world]
    for rung, overrides in rungs:
        cfg = load_config(None, [*TINY, *overrides])
        check_run(cfg, load_strategy(cfg.strategy), world, has_accelerator=True)
    last = load_config(None, [*TINY, *rungs[-1][1]])
    assert last.lora.enabled and last.lora.quantize == "nf4" and not last.memory.optimizer_in_backward
    assert last.optim.grad_clip == 1.0  # restored once optimizer-in-backward is left behind


def test_walk_stops_at_the_first_rung_that_fits() -> None:
    roomy = walk_ladder(None, TINY, 1, 10**12, target="cpu", vocab_size=2048)
    assert first_fit(roomy) is roomy[0]
    assert [r.fits for r in roomy] == [True] * len(roomy)  # QLoRA too: bitsandbytes' NF4 trains on CPU
    assert roomy[-1].estimate.peak.categories["parameters"] < roomy[-2].estimate.peak.categories["parameters"]
    budget = roomy[1].device  # bf16 fits, fp32 (as configured) does not
    assert roomy[0].device > budget
    tight = walk_ladder(None, TINY, 1, budget, target="cpu", vocab_size=2048)
    assert first_fit(tight) is tight[1] and [r.device for r in tight] == [r.device for r in roomy]
    offload = next(r for r in tight if r.rung.name.startswith("ZeRO-Offload"))
    cfg = load_config(None, offload.overrides)
    params = offload.estimate.params_total
    assert offload.offload_s == offload_seconds(cfg, params, 1) > 0 and tight[0].offload_s == 0
