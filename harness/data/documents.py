"""Where documents come from, and which split each belongs to.

A source is the embedded corpus (text every Python installation has), local files (text,
JSON lines, JSON, parquet; a directory of them) or a hub dataset; `open_documents` gives
it as a `datasets.Dataset` (memory-mapped Arrow, so a corpus larger than memory is fine)
and `open_stream` as an `IterableDataset` read on the fly. Splits are by document, by a
seeded hash of its content: the same on every rank, launcher and world size, and no text
crosses from train to eval or calibration.
"""

from __future__ import annotations

import glob
import hashlib
import os
from pydoc_data.topics import topics
from typing import TYPE_CHECKING

import numpy as np

from harness.config import EMBEDDED_CORPORA, DataConfig
from harness.data.formats import format_hint
from harness.errors import ConfigError
from harness.log import get_logger

log = get_logger(__name__)

if TYPE_CHECKING:
    import datasets

# `datasets` and the tokenizer classes are imported where a cache is prepared or a stream read: they
# cost a second or more per process, and a run whose cache is ready (nearly every run) never uses them.

SPLITS = ("train", "eval", "calib")
SPLIT_CODE = {name: i for i, name in enumerate(SPLITS)}
EOS = "<|endoftext|>"
TOKEN_FILE_SUFFIXES = (".npy", ".bin")  # a flat, pre-tokenized token stream


# Corpora every Python installation carries, by `data.source` name: "embedded" is the first
# ~3M characters (the default: a run in a minute), "stdlib" all of the standard library,
# packages and tests included (~32M characters on CPython 3.11; the pruning benchmark's,
# where a model has to be trained long enough that pruning hurts).
EMBEDDED_SOURCES: dict[str, int | None] = dict(zip(EMBEDDED_CORPORA, (3_000_000, None), strict=True))


def embedded_documents(max_chars: int | None = 3_000_000) -> list[str]:
    """Text every Python installation has: pydoc topics and standard-library sources.

    Sorted and capped (`max_chars`; None: the whole library, subpackages included, without
    site-packages), so the corpus is deterministic for a given Python version.
    """
    docs: list[str] = []
    try:
        docs += [topics[k] for k in sorted(topics)]
    except ImportError:  # some distributions strip pydoc_data
        pass
    stdlib = os.path.dirname(os.__file__)
    if max_chars is None:
        paths = [
            p
            for p in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True))
            if "site-packages" not in os.path.relpath(p, stdlib).split(os.sep)
        ]
    else:
        paths = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    total = sum(map(len, docs))
    for path in paths:
        if max_chars is not None and total >= max_chars:
            break
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        docs += _pieces(text)
        total += len(text)
    return [d for d in docs if d.strip()]


def _pieces(text: str, size: int = 4000) -> list[str]:
    """Cut a long source file at line breaks into ~`size`-character documents.

    A module is thousands of lines; as one document it would put all of itself in one split.
    """
    out, current, length = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line)
        if length >= size and line.strip() == "":
            out.append("".join(current))
            current, length = [], 0
    if current:
        out.append("".join(current))
    return out


def split_of(doc: str | bytes, cfg: DataConfig) -> str:
    """The split of a document (text, or the bytes of its token ids), from a seeded hash of it."""
    data = f"{cfg.seed}:".encode() + (doc if isinstance(doc, bytes) else doc.encode())
    h = int.from_bytes(hashlib.sha256(data).digest()[:8], "little") / 2**64
    if h < cfg.eval_fraction:
        return "eval"
    if h < cfg.eval_fraction + cfg.calib_fraction:
        return "calib"
    return "train"


def split_codes(texts: list[str], cfg: DataConfig) -> np.ndarray:
    """`SPLIT_CODE` of each text (vectorised over a batch)."""
    return np.fromiter((SPLIT_CODE[split_of(t, cfg)] for t in texts), dtype=np.int8, count=len(texts))


LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}  # anything else: text
DOC_FILES = ("readme", "license", "licence", "changelog", "citation", ".gitattributes", ".gitignore")  # a dataset's own documentation


def loader_of(path: str) -> str:
    return LOADERS.get(os.path.splitext(path)[1].lower(), "text")


def data_files(source: str) -> list[str]:
    """The files of a source; a directory mixing kinds is read by one loader only when the others
    are its documentation (README, LICENSE, ...: left out, and said), else it is refused."""
    files = sorted(glob.glob(os.path.join(source, "**", "*"), recursive=True)) if os.path.isdir(source) else [source]
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise ConfigError(f"data.source '{source}' holds no files")
    kinds = sorted({loader_of(f) for f in files})
    if len(kinds) == 1:
        return files
    docs = [f for f in files if os.path.basename(f).lower().startswith(DOC_FILES)]
    data = [f for f in files if f not in docs]
    if data and len({loader_of(f) for f in data}) == 1:
        log.info(
            f"data.source '{source}': reading {len(data)} {loader_of(data[0])} file(s); left out {', '.join(map(os.path.basename, docs))}"
        )
        return data
    by_kind = {k: [os.path.relpath(f, source) for f in files if loader_of(f) == k] for k in kinds}
    shown = "; ".join(f"{k}: {', '.join(v[:3])}{', ...' if len(v) > 3 else ''}" for k, v in by_kind.items())
    raise ConfigError(
        f"data.source '{source}' mixes files of {len(kinds)} kinds ({shown}), each needing its own reader; "
        "put one kind in the directory, or point data.source at one file"
    )


def _builder(files: list[str]) -> tuple[str, dict]:
    builder = loader_of(files[0])
    return builder, ({"sample_by": "document"} if builder == "text" else {})


def is_token_file(source: str) -> bool:
    return os.path.isfile(source) and source.endswith(TOKEN_FILE_SUFFIXES)


def open_documents(cfg: DataConfig) -> datasets.Dataset:
    """The whole source as one map-style dataset (Arrow, memory-mapped for files and the hub)."""
    import datasets

    if cfg.source in EMBEDDED_SOURCES:
        return datasets.Dataset.from_dict({cfg.text_field: embedded_documents(EMBEDDED_SOURCES[cfg.source])})
    if os.path.exists(cfg.source):
        builder, kwargs = _builder(data_files(cfg.source))
        ds = datasets.load_dataset(builder, data_files=data_files(cfg.source), split="train", **kwargs)
    else:
        try:
            ds = datasets.load_dataset(cfg.source, split="train")
        except Exception as exc:
            raise ConfigError(
                f"data.source '{cfg.source}' is not a local path and could not be loaded from the hub ({type(exc).__name__})"
            ) from None
    check_columns(ds.column_names, cfg)
    return ds


def open_stream(cfg: DataConfig) -> datasets.IterableDataset:
    """The source read on the fly (`data.streaming`): nothing is converted or cached on disk."""
    import datasets

    if cfg.source in EMBEDDED_SOURCES:
        docs = embedded_documents(EMBEDDED_SOURCES[cfg.source])
        return datasets.Dataset.from_dict({cfg.text_field: docs}).to_iterable_dataset(num_shards=8)
    if os.path.exists(cfg.source):
        builder, kwargs = _builder(data_files(cfg.source))
        ds = datasets.load_dataset(builder, data_files=data_files(cfg.source), split="train", streaming=True, **kwargs)
    else:
        try:
            ds = datasets.load_dataset(cfg.source, split="train", streaming=True)
        except Exception as exc:
            raise ConfigError(f"data.source '{cfg.source}' could not be streamed from the hub ({type(exc).__name__})") from None
    if ds.column_names is not None:
        check_columns(ds.column_names, cfg)
    return ds


def check_columns(columns: list[str], cfg: DataConfig) -> None:
    if cfg.text_field not in columns and "input_ids" not in columns:
        raise ConfigError(
            f"data.source '{cfg.source}' has no column '{cfg.text_field}' (columns: {', '.join(columns)}); "
            f"set data.text_field, or give pre-tokenized data with an 'input_ids' column{format_hint(columns)}"
        )


def pretokenized(columns: list[str], cfg: DataConfig) -> bool:
    """Pre-tokenized input: an `input_ids` column and no text column to tokenize."""
    return "input_ids" in columns and cfg.text_field not in columns
