"""Folders the `datasets` library writes or reads whole: a `save_to_disk` folder (a Dataset, or a
DatasetDict of splits) and a local folder laid out as a Hub dataset repository (a README beside
`data/` files named by split). They are opened with `datasets`' own readers, so a split the folder
names is the split it means: a DatasetDict's `train` trains and its test/validation split
evaluates (`GIVEN_SPLIT`), rather than every file being pooled and split again by hash.
"""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING

from harness.config import DataConfig
from harness.data.documents import SPLIT_CODE, check_columns
from harness.errors import ConfigError
from harness.log import get_logger

if TYPE_CHECKING:
    import datasets

log = get_logger(__name__)

SAVED_MARKERS = ("dataset_dict.json", "state.json")  # DatasetDict.save_to_disk, Dataset.save_to_disk
REPO_CARD, REPO_DATA = "README.md", "data"  # a Hub dataset repository: its card and its data folder
EVAL_SPLIT_NAMES = ("validation", "valid", "eval", "dev", "test")  # the first a DatasetDict has evaluates
GIVEN_SPLIT = "__harness_split__"  # column of a DatasetDict's documents: EVAL_CODE, or TRAIN_PART (hashed)
TRAIN_PART = -1  # a document of the `train` split: train or calib by its hash, never eval


def folder_layout(source: str) -> str | None:
    """ "saved" (a save_to_disk folder), "repo" (a Hub dataset repository's layout) or None (plain files)."""
    if not os.path.isdir(source):
        return None
    if any(os.path.isfile(os.path.join(source, m)) for m in SAVED_MARKERS):
        return "saved"
    if os.path.isfile(os.path.join(source, REPO_CARD)) and os.path.isdir(os.path.join(source, REPO_DATA)):
        return "repo"
    return None


def check_arrow_files(paths: list[str]) -> None:
    """Every .arrow file opens as Arrow (memory-mapped, so a large one costs no memory): a damaged
    file is one line naming it here, not a loader's traceback during preparation."""
    import datasets  # lazily, see harness.data.documents

    for path in paths:
        try:
            datasets.Dataset.from_file(path)
        except Exception as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise ConfigError(f"data.source file '{path}' is not a readable Arrow file ({type(exc).__name__}: {reason})") from None


def saved_splits(source: str) -> list[str] | None:
    """The splits a save_to_disk folder holds (None: a single Dataset), from its own index."""
    index = os.path.join(source, SAVED_MARKERS[0])
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        return list(json.load(f).get("splits", []))


def check_saved_folder(source: str, cfg: DataConfig) -> None:
    """What pre-flight can say of a save_to_disk folder without tokenizing it: a `train` split, the
    text column, and every Arrow file readable."""
    splits = saved_splits(source)
    if splits is not None and "train" not in splits:
        raise ConfigError(
            f"data.source '{source}' is a DatasetDict without a 'train' split (splits: {', '.join(splits) or 'none'}); "
            "save the training documents as 'train' (a 'test' or 'validation' split evaluates)"
        )
    info = os.path.join(source, "train" if splits is not None else "", "dataset_info.json")
    if os.path.isfile(info):
        with open(info) as f:
            check_columns(list(json.load(f).get("features") or {}), cfg)
    check_arrow_files(sorted(glob.glob(os.path.join(source, "**", "*.arrow"), recursive=True)))


def open_folder(source: str, layout: str, cfg: DataConfig) -> datasets.Dataset:
    """The folder's documents as one Dataset; a DatasetDict's with a `GIVEN_SPLIT` column."""
    import datasets  # lazily, see harness.data.documents

    if layout == "saved":
        check_saved_folder(source, cfg)
        loaded = datasets.load_from_disk(source)
    else:
        loaded = datasets.load_dataset(source)
    if isinstance(loaded, datasets.Dataset):
        return loaded
    parts = _given_splits(loaded, source)
    try:
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    except ValueError as exc:
        raise ConfigError(f"data.source '{source}': its train and eval splits have different columns ({exc})") from None


def _given_splits(loaded: datasets.DatasetDict, source: str) -> list[datasets.Dataset]:
    """The train split, and the eval split the DatasetDict names, each document marked (`GIVEN_SPLIT`)."""
    if "train" not in loaded:
        raise ConfigError(
            f"data.source '{source}' has no 'train' split (splits: {', '.join(loaded)}); name the training documents' split 'train'"
        )
    evaluate = next((name for name in EVAL_SPLIT_NAMES if name in loaded), None)
    unused = [name for name in loaded if name not in ("train", evaluate)]
    if unused:
        log.info(f"data.source '{source}': left out its split(s) {', '.join(unused)}")
    if evaluate is None:  # train alone: split by hash, as any other documents
        return [loaded["train"]]
    log.info(f"data.source '{source}': split 'train' trains (calib by hash), split '{evaluate}' evaluates")
    return [
        loaded["train"].add_column(GIVEN_SPLIT, [TRAIN_PART] * len(loaded["train"])),
        loaded[evaluate].add_column(GIVEN_SPLIT, [SPLIT_CODE["eval"]] * len(loaded[evaluate])),
    ]
