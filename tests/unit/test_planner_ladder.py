"""The memory ladder: every rung a valid config here, walked in order, the first that fits chosen."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config import check_run, load_config, load_strategy
from harness.memory import pinned_block
from harness.planner.estimate import estimate
from harness.planner.ladder import RUNGS, first_fit, offload_seconds, rung_overrides, walk_ladder
from harness.planner.long_context import sequence_degree
from harness.planner.model_states import fsdp_local_numel
from harness.planner.optimizer_model import EngineSpec, step_bytes_per_element
from harness.planner.params import param_info
from harness.planner.trace import build_fake_model
from harness.training import name_compiles_step

TINY = ["model.name=tiny-llama", "data.seq_len=64", "micro_batch_size=2"]


@pytest.mark.parametrize("world", [1, 2])
def test_every_rung_is_a_config_the_trainer_accepts(world: int) -> None:
    rungs = rung_overrides(world)
    # no degree given: no such rung, nor one that applies only while the experts are split
    splits = [r for r in RUNGS if r.while_split or any("{sequence}" in o or "{expert}" in o for o in r.overrides)]
    assert [r.name for r, _ in rungs] == [r.name for r in RUNGS if r.min_world <= world <= (r.max_world or world) and r not in splits]
    for rung, overrides in rungs:
        cfg = load_config(None, [*TINY, *overrides])
        check_run(cfg, load_strategy(cfg.strategy), world, has_accelerator=True)
    last = load_config(None, [*TINY, *rungs[-1][1]])
    assert last.lora.enabled and last.lora.quantize == "nf4" and not last.memory.optimizer_in_backward
    assert last.optim.grad_clip == 1.0  # restored once optimizer-in-backward is left behind


def test_the_sequence_parallel_rung_keeps_the_global_batch_and_drops_what_it_refuses() -> None:
    """With a degree, the rung splits each sequence and multiplies the user's accumulation by it; the
    optimizer-in-backward rung (refused with it) is left out; every later rung keeps the split (the
    DeepSpeed rungs run it as ALST, offload included). Every rung a config the trainer accepts."""
    rungs = rung_overrides(2, sequence=2, grad_accum=3)
    names = [r.name for r, _ in rungs]
    split = next(i for i, n in enumerate(names) if n.startswith("sequence parallelism"))
    assert not any(n.startswith("optimizer step inside backward") for n in names)
    for i, (rung, overrides) in enumerate(rungs):
        cfg = load_config(None, [*TINY, "grad_accum=3", *overrides])
        check_run(cfg, load_strategy(cfg.strategy), 2, has_accelerator=True)
        assert (cfg.parallel.sequence, cfg.grad_accum) == ((2, 6) if split <= i else (1, 3)), rung.name
    zero = next(o for r, o in rungs if r.name.startswith("ZeRO-Offload"))
    assert "strategy=zero2_offload" in zero and "parallel.sequence=2" in zero and "grad_accum=6" in zero


def test_the_expert_parallel_rung_splits_the_experts_until_a_rung_leaves_ddp_and_fsdp2(tmp_path) -> None:
    """A mixture of experts under DDP: the degree is the largest that divides the world and the experts
    (the user's own kept); the rung splits them, the next adds activation checkpointing with them split,
    more sharding (DDP's step to FSDP2) keeps them split, as do the memory techniques after it, and the
    first rung that leaves DDP and FSDP2's torch optimizers (the step inside backward) sets
    parallel.expert=1, keeping the recomputation (its own rung turned it on by then); every rung a config
    the trainer accepts. The search offers the split under DDP and FSDP2, and its most frugal corner
    does not split."""
    from model_families import moe_configs

    from harness.planner.candidates import candidates, most_frugal, with_candidate, with_split
    from harness.planner.moe import expert_degree

    moe_configs(4)["qwen3_moe"].save_pretrained(tmp_path)
    moe = [f"model.name={tmp_path}", "data.seq_len=64", "micro_batch_size=2", "strategy=ddp"]
    assert [expert_degree(load_config(None, moe), world) for world in (1, 2, 3, 8)] == [1, 2, 1, 4]
    assert expert_degree(load_config(None, TINY), 8) == 1  # dense: nothing to split
    assert expert_degree(load_config(None, [*moe, "parallel.expert=2"]), 8) == 2  # the user's own

    rungs = rung_overrides(2, expert=2)
    names = [r.name for r, _ in rungs]
    split = next(i for i, n in enumerate(names) if n.startswith("expert parallelism"))
    assert names[split + 1].endswith("the experts still split") and names[split + 2].startswith("more sharding")
    left = next(i for i, n in enumerate(names) if n.startswith("optimizer step inside backward"))
    assert left > split + 3  # chunked loss, tiled MLP, checkpoint-input offload: still split
    for i, (rung, overrides) in enumerate(rungs):
        cfg = load_config(None, [*TINY, *overrides])
        check_run(cfg, load_strategy(cfg.strategy), 2, has_accelerator=True)
        assert cfg.parallel.expert == (2 if split <= i < left else 1), rung.name
        assert (cfg.memory.activation_checkpointing == "full") == (i > split), rung.name
        if i == split + 2:
            assert cfg.strategy == "fsdp", rung.name
    asked = rung_overrides(2, expert=2, user_expert=2)  # the user split them: no rung; FSDP2 keeps them, the step inside backward not
    assert not any(r.name.startswith("expert parallelism") for r, _ in asked)
    assert "parallel.expert=1" not in next(o for r, o in asked if r.name.startswith("more sharding"))
    assert next(o for r, o in asked if r.name.startswith("optimizer step inside"))[-1] == "parallel.expert=1"
    from_fsdp = rung_overrides(2, strategy=load_strategy("fsdp", env={}), expert=2)  # FSDP2's run gets the rung too
    assert any(r.name.startswith("expert parallelism") for r, _ in from_fsdp)

    cfg = load_config(None, moe)
    searched = {(c.strategy, c.expert) for c in candidates(cfg, 2, nvme=False, target="cuda")}
    assert {("ddp", 2), ("fsdp", 2)} <= searched and all(load_strategy(s).kind in ("ddp", "fsdp") for s, e in searched if e > 1)
    split_cfg = load_config(None, [*moe, "parallel.expert=2"])
    assert with_candidate(split_cfg, most_frugal(split_cfg, 2, nvme=False)).parallel.expert == 1
    # the search's untraced model-state bound holds a rank's share of the experts, as the trace does
    from harness.models import empty_model, expert_tensors, model_config
    from harness.planner.recommend import _model_state_floor, _param_info

    info = _param_info(cfg.model.name, None)
    experts = sum(p.numel() for p in expert_tensors(empty_model(model_config(str(tmp_path)))).values())
    assert info.split(2).total == info.total - experts // 2 and info.split(2).split_expert_numel == experts // 2
    floors = {e: _model_state_floor(with_split(cfg, 1, e), 2, "cuda", info, None) for e in (1, 2)}
    assert floors[1] - floors[2] == experts // 2 * 4 * 4  # fp32 parameters, gradients and AdamW's two states
    fsdp = dataclasses.replace(cfg, strategy="fsdp")  # each rank's range sharded over its replicas: 1/world of the experts
    sharded = {e: _model_state_floor(with_split(fsdp, 1, e), 4, "cuda", info, None) for e in (1, 2)}
    assert sharded[1] == sharded[2]


def test_sequence_degree_is_the_largest_split_the_world_heads_and_length_allow() -> None:
    """tiny-llama: 4 heads, 2 key/value heads (replicated over a group of 4: the query heads cap N)."""
    cfg = load_config(None, TINY)
    assert [sequence_degree(cfg, world, 2048) for world in (1, 2, 3, 4, 8)] == [1, 2, 1, 4, 4]
    assert sequence_degree(load_config(None, [*TINY, "data.seq_len=63"]), 2, 2048) == 1
    assert sequence_degree(load_config(None, [*TINY, "parallel.sequence=2"]), 2, 2048) == 1  # already split


def test_walk_stops_at_the_first_rung_that_fits() -> None:
    roomy = walk_ladder(None, TINY, 1, 10**12, target="cpu", vocab_size=2048)
    assert first_fit(roomy) is roomy[0]
    assert [r.fits for r in roomy] == [True] * len(roomy)  # QLoRA too: bitsandbytes' NF4 trains on CPU
    lora, qlora, offloaded = (r.estimate.peak.categories["parameters"] for r in roomy[-3:])
    assert qlora < lora
    # The offload rung runs FSDP2 at world 1 (the one-process QLoRA rung above it does not). On a CPU
    # machine the host is the device, so it is planned as FSDP2's QLoRA: offload saves nothing.
    sharded = [*roomy[-1].overrides[:-1], "strategy=fsdp"]
    assert roomy[-1].overrides[-1] == "strategy=fsdp_offload"
    assert (roomy[-2].estimate.engine, roomy[-1].estimate.engine) == ("single", "fsdp")
    assert roomy[-1].estimate.total == estimate(load_config(None, sharded), 1, target="cpu", vocab_size=2048).total
    gpu = walk_ladder(None, TINY, 1, 10**12, target="cuda", vocab_size=2048)
    qlora, offloaded = (r.estimate.peak.categories["parameters"] for r in gpu[-2:])
    assert offloaded < qlora  # on a GPU FSDP2's offload leaves only the quantization state on the device
    budget = roomy[1].device  # bf16 fits, fp32 (as configured) does not
    assert roomy[0].device > budget
    tight = walk_ladder(None, TINY, 1, budget, target="cpu", vocab_size=2048)
    assert first_fit(tight) is tight[1] and [r.device for r in tight] == [r.device for r in roomy]
    offload = next(r for r in tight if r.rung.name.startswith("ZeRO-Offload"))
    cfg = load_config(None, offload.overrides)
    params = offload.estimate.params_total
    assert offload.offload_s == offload_seconds(cfg, params, 1) > 0 and tight[0].offload_s == 0


def test_optimizer_in_backward_frees_gradients_whatever_the_step_costs() -> None:
    """Each hook steps and frees its gradient, also for an optimizer whose step makes no temporaries
    (SGD without weight decay; bitsandbytes' fused GPU step): no moment holds the gradients."""
    short = ["model.name=tiny-llama", "data.seq_len=8", "micro_batch_size=1", "optim.name=sgd", "optim.weight_decay=0"]
    plain = estimate(load_config(None, short), 1, target="cpu", vocab_size=2048)
    assert plain.peak.categories["gradients"] > 0  # few activations: the peak is in backward, gradients held
    oib = ["memory.optimizer_in_backward=true", "optim.grad_clip=0"]
    est = estimate(load_config(None, [*short, *oib]), 1, target="cpu", vocab_size=2048)
    assert all(m.categories["gradients"] == 0 for m in est.moments) and est.total < plain.total


def test_paged_rung_counts_its_paged_states_on_the_host() -> None:
    """On a GPU the paged rung's 8-bit moments of the tensors bitsandbytes pages (>= 1e5 elements) are
    host memory; on CPU (no paging) the same rung holds them like any state."""
    info = param_info(build_fake_model("tiny-llama", 2048, FakeTensorMode(), torch.bfloat16))
    paged = 2 * sum(n for n in info.numels if n >= 100_000)
    assert paged > 0
    for target, host in (("cuda", paged), ("cpu", 0)):
        results = walk_ladder(None, TINY, 1, 10**12, target=target, vocab_size=2048)
        rung = next(r for r in results if r.rung.name.startswith("paged 8-bit"))
        cfg = load_config(None, rung.overrides)
        assert (cfg.optim.name, cfg.precision, cfg.memory.optimizer_in_backward) == ("paged_adamw_8bit", "bf16", True)
        assert rung.estimate.host.get("optimizer_state", 0) == host


def test_fsdp2_holds_no_collective_buffer_into_the_optimizer_step() -> None:
    """FSDP2's root post-backward callback, after the last op a trace sees, reshards every group
    and releases the reduce-scatter inputs it retained: the optimizer step holds the sharded
    parameters, gradients and states, the step's temporaries and at most gloo's one buffer (the
    race window). The plan carried the last reduce-scatter's input into the step as well, and
    over-predicted torchao's 8-bit, 4-bit and bf16-rounding steps at world 2 by 8-35% on
    small-llama, where the allocator measured the held state plus the temporaries to 0.03%
    (notes/optimizers.md)."""
    overrides = [*TINY, "strategy=fsdp", "optim.name=adamw_8bit"]
    est = estimate(load_config(None, overrides), 2, target="cpu", vocab_size=2048)
    moments = {m.name: m for m in est.moments}
    end, step = moments["end of backward"], moments["optimizer step"]
    assert est.race_bytes > 0 and end.categories["communication"] == est.race_bytes
    local = max(fsdp_local_numel(s, 2) for s in param_info(build_fake_model("tiny-llama", 2048, FakeTensorMode())).shapes)
    spec = EngineSpec(
        kind="fsdp", world=2, precision="fp32", optimizer="adamw_8bit", target="cpu", compiled_step=name_compiles_step("adamw_8bit")
    )
    assert step.total - end.total == math.ceil(step_bytes_per_element(spec) * local)  # the step adds its temporaries, nothing else


def test_fsdp2_accumulates_sharded_gradients_not_the_whole_models() -> None:
    """FSDP2 reduce-scatters every micro-batch, as the engine does: with accumulation the peak holds
    the sharded gradients and one group's unsharded ones, never every group's (skipping the
    reduce-scatter until the last micro-batch kept the whole model's gradients on each rank:
    Qwen3-30B-A3B at 8 ranks 161 GiB, not 64). Held to a real step by test_planner_accuracy.py."""
    overrides = [*TINY, "strategy=fsdp", "precision=bf16"]
    info = param_info(build_fake_model("tiny-llama", 2048, FakeTensorMode()))
    one, four = (estimate(load_config(None, [*overrides, f"grad_accum={k}"]), 2, target="cpu", vocab_size=2048) for k in (1, 4))
    whole = 4 * sum(info.numels)  # every parameter's gradient, unsharded, in fp32
    held = four.peak.categories
    assert held["gradients"] == whole // 2 and held.get("temporaries", 0) < whole // 4  # the shards accumulate; before: + whole
    # the price: a reduce-scatter a micro-batch (and the step's traffic is every micro-batch's, not the two traced)
    assert four.traffic == {kind: 4 * sent for kind, sent in one.traffic.items()}


def test_fsdp2_cpu_offload_keeps_the_unsharded_gradients_of_a_group_in_backward_on_the_device() -> None:
    """CPUOffloadPolicy sends each reduce-scattered gradient shard to the host; the unsharded
    gradients a group's backward makes (bf16 under mixed precision) are on the device until its
    reduce-scatter. Vocabulary 256 puts the peak in a block's backward: it holds that block's
    unsharded gradients and the root group's (the final norm's, reduced at the end of backward);
    none are left once backward ends. The plan held 0 gradient bytes on the device all step."""
    cfg = load_config(None, ["model.name=small-llama", "data.seq_len=64", "micro_batch_size=1", "strategy=fsdp_offload", "precision=bf16"])
    est = estimate(cfg, 2, target="cuda", vocab_size=256)
    info = param_info(build_fake_model("small-llama", 256, FakeTensorMode()))
    numel = dict(zip(info.names, info.numels))
    block = re.search(r"layers\.(\d+)\.", est.peak.name)
    assert block is not None, est.peak.name
    unsharded = sum(n for name, n in numel.items() if name.startswith(f"model.layers.{block.group(1)}."))
    assert est.peak.categories["gradients"] == 2 * (unsharded + numel["model.norm.weight"])
    end = next(m for m in est.moments if m.name == "end of backward").categories
    pinned = sum(pinned_block(4 * fsdp_local_numel(s, 2)) for s in info.shapes)  # each shard a pinned block
    assert end["gradients"] == 0 and est.host["gradients"] == pinned


def test_expert_parallelism_under_fsdp2_is_planned_and_searched():
    """The trainer runs FSDP2 with the experts split (each range sharded over its replicas); the planner
    plans it (measured in `test_planner_moe.py`), and the search proposes it, costed as FSDP2."""
    from harness.planner.candidates import runs_with
    from harness.planner.estimate import check_modelled

    cfg = load_config(None, ["precision=fp32", "parallel.expert=2"])
    assert check_modelled(cfg.lora, load_strategy("fsdp", env={}), 2) == "fsdp"
    assert check_modelled(cfg.lora, load_strategy("ddp", env={}), 2) == "ddp"
    assert runs_with(cfg, "ddp", "cuda", world=2, expert=2) and runs_with(cfg, "fsdp", "cuda", world=2, expert=2)
    assert not runs_with(cfg, "zero3", "cuda", world=2, expert=2)
