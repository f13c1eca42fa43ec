"""The gradient norm left on the device until the log step (Observer) and the memory peaks folded
between log steps (MemoryPeaks). The step's one agreement is test_reliability_units.py's; the count
of host syncs per step in a real 2-rank run, test_host_syncs.py's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from harness.config import LoggingConfig
from harness.observability import Observer
from harness.observability import metrics as M
from harness.runner.trainer import MemoryPeaks


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
