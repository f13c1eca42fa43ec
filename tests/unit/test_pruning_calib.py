"""Layer groups of K: G0 does not depend on K, K sets the number of passes, and the
calibration layout makes world x accumulation interchangeable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.config import PruneConfig
from harness.distributed import Collectives
from harness.errors import StopRequested
from harness.models import build_model, decoder_blocks
from harness.pruning import build_views, recording_g0, restore_views, run_pruning, shard_calibration, snapshot_views
from harness.pruning.calibration import Runner, gradient_max


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 2048, (2, 16), generator=g) for _ in range(3)]


def probe(group_size: int, targets: str = "decoder_linears", sequential: bool = False):
    """The run's report, with the G0 it computed as `.g0` (recorded: `recording_g0`)."""
    model = build_model("tiny-llama")
    cfg = PruneConfig(
        method="gradprobe", base="wanda", decision="veto", sparsity=0.5, group_size=group_size, targets=targets, sequential=sequential
    )
    with recording_g0() as g0:
        report = run_pruning(model, calib(), cfg, lm_loss)
    report.g0 = g0
    return report


def test_k1_and_kall_agree_on_g0_and_differ_in_passes() -> None:
    layers = 2  # tiny-llama
    one = probe(group_size=1)
    everything = probe(group_size=layers)
    assert one.group_size == 1 and one.groups == layers
    assert everything.groups == 1
    assert set(one.g0) == set(everything.g0) and len(one.g0) == 7 * layers
    for name in one.g0:
        assert one.g0[name].dtype == torch.bfloat16  # stored in 2 bytes per weight
        assert torch.equal(one.g0[name], everything.g0[name]), name
        assert one.g0[name].abs().sum() > 0
    # the original per-layer streaming: 2 passes per layer; K=all: 2 for the whole model
    assert one.fwd_bwd_passes == 2 * layers
    assert everything.fwd_bwd_passes == 2
    # K=1: block 1's G1 pass replays block 0's outputs from its G0 pass (checked once against
    # a full forward of one micro-batch); K=all probes block 0 itself, so nothing is replayed.
    assert one.replayed_passes == 1 and one.fwd_passes == 1 / len(calib())
    assert everything.replayed_passes == 0 and everything.fwd_passes == 0
    # the probe memory of one group of one layer is smaller than that of the whole model
    assert one.peak_probe_bytes < everything.peak_probe_bytes


def test_probing_one_block_computes_its_gradients_alone_and_bit_exactly() -> None:
    """A probe of block 1 asks autograd for block 1's weights only: the backward never reaches
    block 0, no other parameter gets a gradient, and the statistics equal the full backward's."""
    model = build_model("tiny-llama")
    views = [v for v in build_views(model, "decoder_linears", Collectives()) if v.target.unit == 1]
    steps = Runner(model, lm_loss).steps(calib())
    reached: list[int] = []
    decoder_blocks(model)[0].register_full_backward_hook(lambda *_: reached.append(0))
    full = gradient_max(Runner(model, lm_loss, probed_only=False), steps, views, torch.float32)
    assert reached  # the hook does fire when the backward goes through block 0
    reached.clear()
    runner = Runner(model, lm_loss)
    probed = {id(v.param) for v in views}
    seen: list[str] = []
    for name, p in model.named_parameters():
        if id(p) not in probed:
            p.register_hook(lambda g, name=name: seen.append(name))
    fast = gradient_max(runner, steps, views, torch.float32)
    assert not reached and not seen  # stopped above block 0; no other weight gradient computed
    assert runner.fwd_bwd_batches == len(calib())
    assert set(fast) == set(full) and len(fast) == 7
    for name in full:
        assert torch.equal(fast[name], full[name]), name
        assert full[name].abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())  # zeroed after the pass, like the full path


def test_all_linears_adds_the_lm_head_as_its_own_group() -> None:
    report = probe(group_size=1, targets="all_linears")
    assert "lm_head" in report.g0 and report.groups == 3
    assert report.fwd_bwd_passes == 6


def test_sequential_streaming_changes_later_g0_only() -> None:
    """The reference applied layer n's mask before probing layer n+1; `sequential=True`
    reproduces that, and then only the first group's G0 matches the one-shot statistic."""
    oneshot = probe(group_size=1)
    seq = probe(group_size=1, sequential=True)
    first = [n for n in oneshot.g0 if ".layers.0." in n]
    second = [n for n in oneshot.g0 if ".layers.1." in n]
    assert all(torch.equal(oneshot.g0[n], seq.g0[n]) for n in first)
    assert not all(torch.equal(oneshot.g0[n], seq.g0[n]) for n in second)


class FakeRank(Collectives):
    """Collectives stand-in that only answers rank/world (shard_calibration needs nothing else)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world


def test_shard_calibration_puts_the_same_samples_in_each_probe_step() -> None:
    samples = torch.arange(12 * 3).reshape(12, 3)
    w1 = shard_calibration(samples, micro_batch=1, grad_accum=4, comm=FakeRank(0, 1))
    w2 = [shard_calibration(samples, micro_batch=1, grad_accum=2, comm=FakeRank(r, 2)) for r in range(2)]
    w4 = [shard_calibration(samples, micro_batch=1, grad_accum=1, comm=FakeRank(r, 4)) for r in range(4)]
    steps = 12 // 4
    for t in range(steps):
        one = {tuple(x.flatten().tolist()) for x in w1[t * 4 : t * 4 + 4]}
        two = {tuple(x.flatten().tolist()) for r in range(2) for x in w2[r][t * 2 : t * 2 + 2]}
        four = {tuple(w4[r][t].flatten().tolist()) for r in range(4)}
        assert one == two == four and len(one) == 4


def test_linears_sharing_an_input_share_one_hessian_with_identical_statistics() -> None:
    from harness.pruning import build_views
    from harness.pruning.calibration import InputStats, Runner, forward_pass

    model = build_model("tiny-llama")
    views = build_views(model, "decoder_linears", Collectives())
    runner = Runner(model, lm_loss)
    shared = InputStats(views, hessian=True)
    forward_pass(runner, calib(), shared)
    shared.finalize(Collectives())
    k_proj = [v for v in views if v.name.endswith("layers.0.self_attn.k_proj")]
    alone = InputStats(k_proj, hessian=True)
    forward_pass(runner, calib(), alone)
    alone.finalize(Collectives())
    name = k_proj[0].name
    assert shared.alias[name].endswith("q_proj")  # one accumulator for q, k and v
    assert len(shared.H) == 4 * 2  # per layer: qkv, o, gate/up, down
    assert torch.equal(shared.hessian_of(name), alone.hessian_of(name))
    assert torch.equal(shared.norms(name), alone.norms(name))


def test_masks_chosen_then_weights_restored_leave_the_model_untouched() -> None:
    """What measurements that only want the masks do (snapshot, prune, restore): same masks as
    the applied run, every weight back bit for bit."""
    applied, dry = build_model("tiny-llama"), build_model("tiny-llama")
    cfg = PruneConfig(method="gradprobe", decision="veto", sparsity=0.5, group_size=2)
    a = run_pruning(applied, calib(), cfg, lm_loss)
    views = build_views(dry, cfg.targets, Collectives())
    dense = snapshot_views(views)
    b = run_pruning(dry, calib(), cfg, lm_loss)
    restore_views(views, dense, Collectives())
    for name in a.masks.masks:
        assert torch.equal(a.masks[name], b.masks[name])
    assert all(torch.equal(p, q) for p, q in zip(dry.parameters(), build_model("tiny-llama").parameters()))


@pytest.mark.parametrize("method", ["gradprobe", "wanda"])
def test_a_stop_request_ends_the_pruning_at_the_next_calibration_step(method: str) -> None:
    """Asked before every probe step (forward micro-batch for Wanda): the sixth answer "stop"
    ends the run there, after exactly five micro-batches."""
    asked: list[int] = []

    def should_stop() -> bool:
        asked.append(0)
        return len(asked) > 5

    cfg = PruneConfig(method=method, base="magnitude", decision="original", sparsity=0.5)
    done = "5"
    if method == "wanda":  # streamed block by block: the capture forward stops before the last block
        blocks = len(decoder_blocks(build_model("tiny-llama")))
        cfg, done = PruneConfig(method="wanda", sparsity=0.5), f"{5 * (blocks - 1) / blocks:g}"
    with pytest.raises(StopRequested, match=f"after {done} calibration micro-batches; the pruning was not finished"):
        run_pruning(build_model("tiny-llama"), calib(), cfg, lm_loss, should_stop=should_stop)
    assert len(asked) == 6
