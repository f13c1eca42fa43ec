"""What a run holds out of its data: a calibration split only when it prunes (or
`data.calib_fraction` is written), an eval split that may be too small to evaluate on (said,
not refused, unless the run prunes); a pruning run's splits and cache key as they were."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from harness.config import DataConfig, RunConfig, load_config
from harness.data import PackedData, cache_dir_for, prepare_data
from harness.distributed import DistInfo
from harness.errors import ConfigError
from harness.runner.build import check_eval_split


def alpaca_file(path: Path, n: int) -> Path:
    rows = [{"instruction": f"Add {k} and {k + 1}", "input": "", "output": f"{2 * k + 1}"} for k in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_twenty_record_alpaca_file_prepares_when_nothing_prunes(tmp_path):
    source = alpaca_file(tmp_path / "alpaca.jsonl", 20)
    cfg = load_config(None, [f"data.source={source}", "data.format=instruction", "data.seq_len=64", f"data.cache_dir={tmp_path / 'c'}"])
    assert cfg.data.calib_fraction == 0.0  # no pruning: the calibration documents train
    cache = prepare_data(cfg.model.name, cfg.data, progress=False)
    meta = json.loads((Path(cache) / "meta.json").read_text())
    assert meta["documents"]["calib"] == 0 and sum(meta["documents"].values()) == 20
    assert meta["labelled"]["train"] > 0


def test_a_pruning_run_keeps_its_calibration_split_and_cache_key():
    pruned = load_config(None, ["prune.method=wanda"])
    assert pruned.data.calib_fraction == 0.05
    assert cache_dir_for(pruned.model.name, pruned.data) == cache_dir_for("tiny-llama", DataConfig())
    written = load_config(None, ["data.calib_fraction=0.05"])  # a model trained to be pruned later
    assert written.data.calib_fraction == 0.05
    assert cache_dir_for(written.model.name, written.data) == cache_dir_for("tiny-llama", DataConfig())


def test_pruning_with_no_calibration_split_is_one_line():
    with pytest.raises(ConfigError, match=r"prune.method=wanda calibrates on the calib split, but data.calib_fraction=0"):
        load_config(None, ["prune.method=wanda", "data.calib_fraction=0"])


def _no_eval(seq: int = 64) -> PackedData:
    blocks = {s: np.zeros((n, 3, seq), dtype=np.int32) for s, n in (("train", 4), ("eval", 0), ("calib", 0))}
    return PackedData(blocks, 512, None, "cache", {"train": 4 * seq, "eval": 0, "calib": 0})


def test_an_eval_split_without_a_block_is_said_and_refused_only_when_pruning(caplog):
    info = DistInfo(rank=0, world_size=1, local_rank=0, device="cpu", backend=None)
    with caplog.at_level(logging.WARNING):
        check_eval_split(RunConfig(), _no_eval(), info)
    assert "the run does not evaluate" in caplog.text
    cfg = RunConfig()
    cfg.prune.method = "magnitude"
    with pytest.raises(ConfigError, match="prune.method=magnitude measures eval perplexity: raise data.eval_fraction"):
        check_eval_split(cfg, _no_eval(), info)
