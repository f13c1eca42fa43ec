"""Host syncs per training step, counted in a real 2-rank FSDP2 run (`recording_worker.py`).

A step between two log steps waits on the device exactly once: the step guard's agreement
(one all-reduce of [loss non-finite, stop, norm non-finite, loss], read once before the
optimizer step). The logged loss comes out of that same read; the gradient norm stays on the
device until the log step; the memory peaks are gathered over ranks at log steps only. The
batches' counted tokens are read on the host, where the sampler made them (CPU tensors in
every run, so no device sync), and the model's forward (transformers' causal mask asks whether
the positions are packed, on the device, once per forward): those reads are listed apart, by name.

On CPU (gloo) a "sync" is a blocking call rather than a stalled GPU queue; what is counted
is the same calls a GPU run would make.
"""

from __future__ import annotations

import json

import pytest
from launching import TESTS, launch, tiny_config

pytestmark = pytest.mark.integration

WORKER = str(TESTS / "integration" / "recording_worker.py")
NOT_HARNESS = {
    "harness.training.loss:count_targets:__int__",  # the sampler's CPU batches, counted before they move to the device
    "transformers.masking_utils:find_packed_sequence_indices:__bool__",  # the model's own forward
}
AGREE = "harness.reliability.guard:agree:tolist"


def test_a_step_between_log_steps_syncs_once(tmp_path, data_cache):
    out = tmp_path / "out"
    overrides = {"steps": 7, "strategy": "fsdp", "logging.log_every": 3, "memory.track": True}
    config = tiny_config(tmp_path / "c.yaml", data_cache, out, **overrides)
    launch(WORKER, [str(tmp_path), "--config", str(config)], world=2)
    for rank in range(2):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())["syncs"]
        assert len(steps) == 7
        device = [[s for s in step if s not in NOT_HARNESS] for step in steps]
        for number in (2, 4, 5):  # between log steps (step 1 also measures the state bytes)
            assert device[number - 1] == [AGREE], (rank, number, steps[number - 1])
        for number in (3, 6):  # the log step adds the memory gather (and, on rank 0, the norm's read)
            read_norm = ["harness.observability.metrics:as_number:__float__"] if rank == 0 else []
            expected = [AGREE, "collective:gather_object", *read_norm]
            assert sorted(device[number - 1]) == sorted(expected), (rank, number, steps[number - 1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6, 7]
    for r in train:
        assert r["train/loss"] > 0 and r["train/grad_norm"] > 0 and r["memory/peak_rank"] in (0, 1)
