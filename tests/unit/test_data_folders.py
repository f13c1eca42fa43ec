"""`datasets` folders: a save_to_disk Dataset, its .arrow file, a folder laid out as a Hub dataset
repository give the same token streams as the JSON lines of the same documents; a DatasetDict's
train and test splits are the splits; a DatasetDict without `train` and a damaged .arrow file are
one line naming them, and nothing is left in the cache."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from harness.config import DataConfig
from harness.data import embedded_documents, prepare_data, split_of
from harness.data.tokenizer import train_bpe_tokenizer
from harness.errors import ConfigError

SPLITS = ("train", "eval", "calib")


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return [d[:300] for d in embedded_documents() if d.strip()][:300]


@pytest.fixture(scope="module")
def root(tmp_path_factory, docs) -> Path:
    root = tmp_path_factory.mktemp("folders")
    train_bpe_tokenizer([docs], 400, str(root / "tok"))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "saved"))
    (root / "repo" / "data").mkdir(parents=True)
    (root / "repo" / "README.md").write_text("---\nlicense: mit\n---\n# documents\n")
    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(root / "repo" / "data" / "train-00000-of-00001.parquet"))
    return root


def streams(root: Path, source: Path, cache: Path) -> dict[str, np.ndarray]:
    cfg = DataConfig(source=str(source), tokenizer=str(root / "tok"), seq_len=16, eval_fraction=0.2, cache_dir=str(cache))
    out = Path(prepare_data("tiny-llama", cfg, progress=False))
    meta = json.loads((out / "meta.json").read_text())
    return {s: np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in SPLITS} | {
        f"{s}.docs": np.load(out / f"{s}.docs.npy") for s in SPLITS
    }


@pytest.mark.parametrize("kind", ["saved", "arrow_file", "repo"])
def test_a_datasets_folder_gives_the_tokens_of_the_same_jsonl(root, tmp_path, kind):
    source = {"saved": root / "saved", "arrow_file": root / "saved" / "data-00000-of-00001.arrow", "repo": root / "repo"}[kind]
    expected = streams(root, root / "docs.jsonl", tmp_path / "jsonl")
    got = streams(root, source, tmp_path / kind)
    assert all(len(expected[s]) for s in SPLITS)
    for key, arr in expected.items():
        np.testing.assert_array_equal(got[key], arr, err_msg=key)


def _tokens(root: Path, docs: list[str]) -> np.ndarray:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "tok")
    ids = tok(docs, add_special_tokens=False)["input_ids"]
    return np.array([t for one in ids for t in [*one, tok.eos_token_id]])


@pytest.mark.parametrize("layout", ["saved_dict", "repo"])
def test_a_datasetdicts_splits_are_the_splits(root, docs, tmp_path, layout):
    """`test` is the eval split, whole; `train` is train and calib by hash (its eval-hashed documents train)."""
    train_docs, test_docs = docs[:240], docs[240:]
    source = tmp_path / layout
    if layout == "saved_dict":
        parts = {"train": train_docs, "test": test_docs}
        datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in parts.items()}).save_to_disk(str(source))
    else:
        (source / "data").mkdir(parents=True)
        (source / "README.md").write_text("# documents\n")
        for name, part in (("train", train_docs), ("test", test_docs)):
            datasets.Dataset.from_dict({"text": part}).to_parquet(str(source / "data" / f"{name}-00000-of-00001.parquet"))
    got = streams(root, source, tmp_path / "cache")
    cfg = DataConfig(seed=1234, eval_fraction=0.2)
    calib = [d for d in train_docs if split_of(d, cfg) == "calib"]
    assert 0 < len(calib) < len(train_docs) and any(split_of(d, cfg) == "eval" for d in train_docs)
    np.testing.assert_array_equal(got["eval"], _tokens(root, test_docs))
    np.testing.assert_array_equal(got["calib"], _tokens(root, calib))
    np.testing.assert_array_equal(got["train"], _tokens(root, [d for d in train_docs if d not in calib]))


def _no_directory_left(cache: Path) -> bool:
    return not cache.exists() or not [p for p in cache.iterdir() if p.is_dir()]


def test_a_datasetdict_without_train_is_one_line(root, docs, tmp_path):
    from harness.data import check_saved_folder  # (pre-flight's check)

    source = tmp_path / "no_train"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": docs[:20]})}).save_to_disk(str(source))
    with pytest.raises(ConfigError, match="without a 'train' split \\(splits: test\\)") as err:
        check_saved_folder(str(source), DataConfig())
    assert str(source) in str(err.value)
    with pytest.raises(ConfigError, match="without a 'train' split"):
        streams(root, source, tmp_path / "cache")
    assert _no_directory_left(tmp_path / "cache")


@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_damaged_arrow_file_is_one_line_naming_it(root, tmp_path, where):
    source = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["one document", "another"]}).save_to_disk(str(source))
    arrow = source / "data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[:200])  # cut short, as a copy that stopped
    with pytest.raises(ConfigError) as err:
        streams(root, arrow if where == "file" else source, tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message and str(arrow) in message and "not a readable Arrow file" in message, message
    assert _no_directory_left(tmp_path / "cache")
