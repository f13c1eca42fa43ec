"""The step's one agreement (StepGuard.agree), the gradient norm left on the device until the log
step (Observer), and the memory peaks folded between log steps (MemoryPeaks). The count of host
syncs per step in a real 2-rank run is test_host_syncs.py's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from harness.config import LoggingConfig
from harness.observability import Observer
from harness.observability import metrics as M
from harness.runner.trainer import MemoryPeaks


class _Engine:
    steps_in_backward = False
    module = None


@pytest.fixture
def guard(monkeypatch):
    import harness.reliability.guard as g

    monkeypatch.setattr(g, "install_fault_hooks", lambda *a, **k: None)
    monkeypatch.setattr(g, "weights_finite", lambda *a, **k: True)
    monkeypatch.setattr(g, "signal_received", lambda: False)

    def make(precision: str = "fp32"):
        cfg = SimpleNamespace(checkpoint=SimpleNamespace(on_nonfinite="skip", max_consecutive_skips=5), precision=precision)
        return g.StepGuard(cfg, SimpleNamespace(rank=0, is_main=True), _Engine())

    return make


def test_the_agreement_carries_the_loss_and_skips_a_non_finite_loss_or_norm(guard):
    g = guard()
    agreed = g.agree(torch.tensor(2.5, dtype=torch.float64), torch.tensor(1.0))
    assert (agreed.skip, agreed.loss, g.stop_requested) == (False, 2.5, False)
    assert g.agree(torch.tensor(float("nan"), dtype=torch.float64), torch.tensor(1.0)).skip
    assert g._bad_loss
    g.post_step(SimpleNamespace(grad_norm=torch.tensor(1.0), skipped=True))
    assert (g.nonfinite_steps, g.consecutive) == (1, 1)
    agreed = g.agree(torch.tensor(2.0, dtype=torch.float64), torch.tensor(float("inf")))
    assert agreed.skip and not g._bad_loss
    g.post_step(SimpleNamespace(grad_norm=torch.tensor(float("inf")), skipped=True))  # the agreed flag, not a read
    assert (g.nonfinite_steps, g.consecutive) == (2, 2)
    g.agree(torch.tensor(2.0, dtype=torch.float64), torch.tensor(0.5))
    g.post_step(SimpleNamespace(grad_norm=torch.tensor(0.5), skipped=False))
    assert g.consecutive == 0


def test_fp16_overflow_is_skipped_but_not_counted_as_divergence(guard):
    g = guard("fp16")
    assert g.agree(torch.tensor(2.0, dtype=torch.float64), torch.tensor(float("inf"))).skip  # the scaler's update still runs
    g.post_step(SimpleNamespace(grad_norm=torch.tensor(float("inf")), skipped=True))
    assert g.nonfinite_steps == 0


def test_a_stop_request_is_agreed(guard, monkeypatch):
    import harness.reliability.guard as g

    monkeypatch.setattr(g, "signal_received", lambda: True)
    stopper = guard()
    agreed = stopper.agree(torch.tensor(1.0, dtype=torch.float64), None)  # an engine that measures its norm in its step
    assert stopper.stop_requested and not agreed.skip
    stopper.post_step(SimpleNamespace(grad_norm=float("nan"), skipped=True))  # then the step's own float decides
    assert stopper.nonfinite_steps == 1


def test_a_tensor_grad_norm_is_read_only_when_its_interval_is_written(tmp_path, monkeypatch):
    reads = []
    original = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(1) or original(t))
    logging = LoggingConfig(wandb=False, plots=False, progress=False, log_every=3)
    obs = Observer(str(tmp_path), {}, logging, 0, 1, 3)
    norms = [torch.tensor(x, dtype=torch.float32) for x in (0.1, 0.2, 0.7)]
    for step, norm in enumerate(norms[:2], 1):
        obs.log_step(step, {M.TRAIN_LOSS: 2.0, M.TRAIN_GRAD_NORM: norm})
    assert reads == []
    obs.log_step(3, {M.TRAIN_LOSS: 2.0, M.TRAIN_GRAD_NORM: norms[2]})
    assert len(reads) == 1
    obs.close()
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert train[0][M.TRAIN_GRAD_NORM] == sum(float(n) for n in norms) / 3  # as the host would sum the floats


def test_memory_peaks_fold_to_each_keys_maximum_between_log_steps():
    from harness.distributed import Collectives

    peaks = MemoryPeaks()
    for split, maxima in (({"total": 5, "activations": None}, {"a": 1}), ({"total": 3, "activations": 7}, {"a": 4})):
        peaks.add(SimpleNamespace(last_peaks=lambda s=split: s, last_category_maxima=lambda m=maxima: m))
    out = peaks.reduce(Collectives())
    assert out == {"memory/total_peak_bytes": 5, "memory/activations_peak_bytes": 7, "memory/a_max_bytes": 4}
    assert peaks.reduce(Collectives()) == {}  # the next interval starts empty
