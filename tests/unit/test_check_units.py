"""The check's pieces that need no launch: unpacking packed examples, the bounds, naming the first difference."""

from __future__ import annotations

import pytest
import torch

from harness.config import RunConfig
from harness.data import unpack_examples
from harness.errors import ConfigError
from harness.runner.check import check_config, reference_config
from harness.runner.check_compare import Part, Verdict, grad_bound, judge, merge, sums, update_bound
from harness.training import count_targets

IGNORE = -100


def test_packed_examples_are_unpacked_into_rows_with_the_same_targets() -> None:
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 1, 1])
    labels = torch.tensor([IGNORE, 6, 7, IGNORE, IGNORE, 10, IGNORE, IGNORE])
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])  # two examples, then padding
    batch = torch.stack([ids, labels, positions]).unsqueeze(0)
    rows = unpack_examples(batch)
    assert rows.shape == (2, 3, 8)  # the padding segment has no target: no row
    assert rows[0, 0, :3].tolist() == [5, 6, 7] and rows[1, 0, :3].tolist() == [8, 9, 10]
    assert rows[1, 1].tolist() == [IGNORE, IGNORE, 10] + [IGNORE] * 5
    assert rows[:, 2].tolist() == [list(range(8))] * 2
    assert count_targets(rows) == count_targets(batch) == 3
    text = torch.arange(16).reshape(2, 8)
    assert unpack_examples(text) is text


def test_bounds_grow_with_the_unit_roundoff_and_the_tokens() -> None:
    fp32, bf16 = grad_bound(torch.float32, 512, 2), grad_bound(torch.bfloat16, 512, 2)
    assert 1e-5 < fp32 < 1e-3 < bf16 < 0.5
    assert grad_bound(torch.float32, 1024, 2) > fp32
    assert update_bound(fp32) < update_bound(bf16) <= 1.0


def test_the_first_parameter_beyond_its_bound_is_named_with_its_largest_difference() -> None:
    ref = {"a": torch.ones(4), "b": torch.arange(6.0).reshape(2, 3), "c": torch.ones(2)}
    rank0 = [Part("a", 0, 2, torch.ones(2)), Part("b", 0, 3, torch.tensor([0.0, 1.0, 2.0])), Part("c", 0, 2, None)]
    rank1 = [Part("a", 2, 4, torch.ones(2)), Part("b", 3, 6, torch.tensor([3.0, 4.0, 9.0]))]
    totals = merge([sums(rank0, ref), sums(rank1, ref)])
    verdict = Verdict()
    judge(verdict, 1, "gradient", totals, ["a", "b", "c"], 1e-3, {"b": (2, 3), "a": (4,), "c": (2,)})
    assert verdict.compared == 3 and verdict.first is not None
    assert verdict.first.name == "b" and "at b[1, 2]" in verdict.first.line() and "largest |difference| 4" in verdict.first.line()
    assert totals["c"][5] == 1.0  # the run has no gradient where the reference has one
    renamed = Verdict()  # a parameter the run does not have by the reference's name is a difference, not skipped
    judge(renamed, 1, "gradient", {"a": totals["a"]}, ["a", "d"], 1e-3, {})
    assert renamed.first is not None and renamed.first.name == "d" and "no rank of the run" in renamed.first.line()


def test_what_the_check_cannot_compare_is_refused_and_the_rest_is_the_users_run() -> None:
    for key, value, words in [("streaming", True, "data.streaming"), ("fp16", None, "fp16"), ("oib", None, "optimizer_in_backward")]:
        cfg = RunConfig()
        if key == "streaming":
            cfg.data.streaming = value
        elif key == "fp16":
            cfg.precision = "fp16"
        else:
            cfg.memory.optimizer_in_backward = True
        with pytest.raises(ConfigError, match=words):
            check_config(cfg)
    cfg = RunConfig(strategy="zero3", precision="bf16", micro_batch_size=3, grad_accum=4, output_dir="/runs/x")
    cfg.memory.activation_checkpointing = "full"
    twin = check_config(cfg)
    assert (twin.strategy, twin.precision, twin.micro_batch_size, twin.grad_accum, twin.steps) == ("zero3", "bf16", 3, 4, 2)
    assert twin.output_dir == "/runs/x/check/run" and twin.memory.activation_checkpointing == "full"
    ref = reference_config(twin, world=2, rank=1)
    assert (ref.strategy, ref.precision, ref.micro_batch_size, ref.grad_accum) == ("ddp", "fp32", 24, 1)
    assert ref.memory.activation_checkpointing == "none" and ref.output_dir == "/runs/x/check/reference-rank1"
    assert cfg.steps == 50 and cfg.output_dir == "/runs/x"  # the user's config is left as it was
