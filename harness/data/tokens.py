"""Documents to token streams: the batch encoder the tokenizer processes run, and the writer
that appends each document's tokens (EOS-terminated) to its split's stream file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from harness.config import DataConfig
from harness.data.documents import SPLIT_CODE, SPLITS, split_codes, split_of
from harness.data.folders import GIVEN_SPLIT, TRAIN_PART
from harness.data.tokenizer import leading_specials
from harness.errors import ConfigError

if TYPE_CHECKING:
    import datasets

TRAIN, EVAL = SPLIT_CODE["train"], SPLIT_CODE["eval"]
TOKEN_FILE_CHUNK = 1 << 24  # tokens read at a time from a flat token file
TOKEN_FILE_DOC = 4096  # document length assumed in a flat token file without an end-of-document id


@dataclass
class Work:
    """What a tokenizer process needs (inherited through fork, never pickled)."""

    ds: datasets.Dataset
    tok: Any
    cfg: DataConfig
    eos: int
    dtype: type
    pretokenized: bool


WORK: Work | None = None  # set by the parent right before it forks the pool


@dataclass
class Encoded:
    codes: np.ndarray  # split code of each document (int8)
    lens: np.ndarray  # tokens of each document, its EOS included (int64)
    flat: np.ndarray  # the documents' tokens, each followed by EOS
    nbytes: int  # input bytes this batch covered (for throughput)
    max_id: int


def doc_key(ids: np.ndarray) -> bytes:
    """What a tokenized document's split is hashed from: its ids (no EOS) as int64, whatever the file's dtype."""
    return np.asarray(ids, dtype=np.int64).tobytes()


def _kept(batch: list[Any]) -> list[int]:
    """The documents that are text with something in it."""
    return [i for i, t in enumerate(batch) if isinstance(t, str) and t.strip()]


def _texts(batch: list[Any]) -> list[str]:
    return [batch[i] for i in _kept(batch)]


def given_codes(codes: np.ndarray, given: list[int] | None) -> np.ndarray:
    """The split codes where the source names the split (a DatasetDict's, `GIVEN_SPLIT`): its eval
    documents evaluate, its train documents are train or calib by their hash, never eval."""
    if given is None:
        return codes
    given_arr = np.asarray(given, dtype=np.int8)
    return np.where(given_arr != TRAIN_PART, given_arr, np.where(codes == EVAL, TRAIN, codes)).astype(np.int8)


def encode(work: Work, task: tuple[int, int], skip_train: bool) -> Encoded:
    """Tokenize documents [start, end) with one batch call; `skip_train`: the train split is full."""
    start, end = task
    rows = work.ds[start:end]
    if work.pretokenized:
        kept = [i for i, ids in enumerate(rows["input_ids"]) if ids is not None and len(ids)]
        docs = [np.asarray(rows["input_ids"][i], dtype=np.int64) for i in kept]
        codes = np.fromiter((SPLIT_CODE[split_of(doc_key(d), work.cfg)] for d in docs), dtype=np.int8, count=len(docs))
        codes = given_codes(codes, [rows[GIVEN_SPLIT][i] for i in kept] if GIVEN_SPLIT in rows else None)
        keep = [i for i in range(len(docs)) if not (skip_train and codes[i] == TRAIN)]
        ids_list: list[Any] = [docs[i] for i in keep]
        nbytes = sum(d.nbytes for d in docs)
        return _pack(ids_list, codes[keep], nbytes, work.eos, work.dtype)
    kept = _kept(rows[work.cfg.text_field])
    texts = [rows[work.cfg.text_field][i] for i in kept]
    given = [rows[GIVEN_SPLIT][i] for i in kept] if GIVEN_SPLIT in rows else None
    return encode_texts(texts, work.tok, work.cfg, work.eos, work.dtype, skip_train, given)


def encode_texts(
    texts: list[str], tok: Any, cfg: DataConfig, eos: int, dtype: type, skip_train: bool, given: list[int] | None = None
) -> Encoded:
    codes = given_codes(split_codes(texts, cfg), given)
    keep = [i for i in range(len(texts)) if not (skip_train and codes[i] == TRAIN)]
    ids_list = tok([texts[i] for i in keep], add_special_tokens=False)["input_ids"] if keep else []
    prefix = leading_specials(tok)  # a BOS the tokenizer puts before every text: every document keeps it
    if prefix:
        ids_list = [prefix + list(ids) for ids in ids_list]
    nbytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return _pack(ids_list, codes[keep], nbytes, eos, dtype)


def _pack(ids_list: list[Any], codes: np.ndarray, nbytes: int, eos: int, dtype: type) -> Encoded:
    """The documents' ids as one flat array, each followed by `eos`."""
    lens = np.fromiter((len(ids) + 1 for ids in ids_list), dtype=np.int64, count=len(ids_list))
    flat = np.empty(int(lens.sum()), dtype=dtype)
    pos = 0
    for ids, n in zip(ids_list, lens):
        flat[pos : pos + n - 1] = ids
        flat[pos + n - 1] = eos
        pos += n
    max_id = max((int(np.max(ids)) for ids in ids_list if len(ids)), default=eos)
    return Encoded(codes, lens, flat, nbytes, max(max_id, eos))


def encode_inherited(task: tuple[int, int], skip_train: bool) -> Encoded:
    assert WORK is not None, "the tokenizer pool was started without its work"
    return encode(WORK, task, skip_train)


@dataclass
class SplitWriter:
    """Appends documents to `<out>/<split>.bin` in order; `max_tokens` caps the train split (the
    document that reaches the cap is kept whole, as is every eval and calib document)."""

    out: str
    dtype: type
    max_tokens: int | None
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    documents: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    nbytes: int = 0
    max_id: int = 0

    def __post_init__(self) -> None:
        self._files = {s: open(os.path.join(self.out, f"{s}.bin"), "wb") for s in SPLITS}
        self._starts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}

    @property
    def train_full(self) -> bool:
        return self.max_tokens is not None and self.tokens["train"] >= self.max_tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())

    def add(self, enc: Encoded) -> None:
        self.nbytes += enc.nbytes
        self.max_id = max(self.max_id, enc.max_id)
        if not len(enc.lens):
            return
        ends = np.cumsum(enc.lens)
        starts = ends - enc.lens
        for split, code in SPLIT_CODE.items():
            sel = np.flatnonzero(enc.codes == code)
            if split == "train" and self.max_tokens is not None and len(sel):
                before = self.tokens["train"] + np.concatenate(([0], np.cumsum(enc.lens[sel])[:-1]))
                sel = sel[before < self.max_tokens]
            if not len(sel):
                continue
            pieces = [enc.flat[s:e] for s, e in zip(starts[sel], ends[sel])]
            chunk = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
            self._starts[split].append(self.tokens[split] + np.concatenate(([0], np.cumsum(enc.lens[sel])[:-1])))
            self._files[split].write(chunk.astype(self.dtype, copy=False).tobytes())
            self.tokens[split] += int(chunk.size)
            self.documents[split] += len(sel)

    def close(self) -> dict[str, Any]:
        for split, f in self._files.items():
            f.close()
            starts = np.concatenate(self._starts[split]) if self._starts[split] else np.zeros(0, dtype=np.int64)
            np.save(os.path.join(self.out, f"{split}.docs.npy"), starts.astype(np.int64))
        return {
            "tokens": dict(self.tokens),
            "documents": dict(self.documents),
            "bytes": self.nbytes,
            "dtype": np.dtype(self.dtype).name,
            "max_id": self.max_id,
        }


def train_text_batches(ds: datasets.Dataset | datasets.IterableDataset, cfg: DataConfig, batch: int = 1000) -> Iterator[list[str]]:
    """The train split's texts in document order (what a locally trained tokenizer learns from)."""
    if GIVEN_SPLIT in (ds.column_names or []):  # a DatasetDict's (map-style) eval split never trains the tokenizer
        for start in range(0, len(ds), batch):
            rows = ds[start : start + batch]
            kept = _kept(rows[cfg.text_field])
            texts = [rows[cfg.text_field][i] for i in kept]
            codes = given_codes(split_codes(texts, cfg), [rows[GIVEN_SPLIT][i] for i in kept])
            yield [t for t, c in zip(texts, codes) if c == TRAIN]
        return
    for texts in text_batches(ds, cfg, batch):
        yield [t for t, c in zip(texts, split_codes(texts, cfg)) if c == TRAIN]


def text_batches(ds: datasets.Dataset | datasets.IterableDataset, cfg: DataConfig, batch: int = 1000) -> Iterator[list[str]]:
    """Non-empty texts in document order, `batch` documents at a time (map-style or streamed)."""
    import datasets  # lazily, see harness.data.documents

    if isinstance(ds, datasets.Dataset):
        for start in range(0, len(ds), batch):
            yield _texts(ds[start : start + batch][cfg.text_field])
        return
    for rows in ds.iter(batch_size=batch):
        yield _texts(rows[cfg.text_field])


def split_token_file(cfg: DataConfig, out: str, eos: int | None) -> dict[str, Any]:
    """A flat token file (.npy, or raw .bin of `data.token_dtype`) split by document: documents
    end at `eos` (the tokenizer's or `data.eos_id`), else are `TOKEN_FILE_DOC`-token pieces."""
    if cfg.source.endswith(".npy"):
        src = np.load(cfg.source, mmap_mode="r")
    else:
        src = np.memmap(cfg.source, dtype=np.dtype(cfg.token_dtype), mode="r")
    if src.ndim != 1 or src.dtype.kind not in "iu":
        raise ConfigError(
            f"data.source '{cfg.source}': a token file must hold one flat array of integer token ids (got {src.dtype}, shape {src.shape})"
        )
    top = max((int(src[i : i + TOKEN_FILE_CHUNK].max()) for i in range(0, len(src), TOKEN_FILE_CHUNK)), default=0)
    dtype = np.uint16 if top < 2**16 else np.uint32
    writer = SplitWriter(out, dtype, cfg.max_tokens)
    carry = np.zeros(0, dtype=src.dtype)
    for i in range(0, len(src), TOKEN_FILE_CHUNK):
        chunk = np.concatenate((carry, np.asarray(src[i : i + TOKEN_FILE_CHUNK])))
        last = i + TOKEN_FILE_CHUNK >= len(src)
        if eos is not None:
            cuts = np.flatnonzero(chunk == eos) + 1
        else:
            cuts = np.arange(TOKEN_FILE_DOC, len(chunk) + 1, TOKEN_FILE_DOC)
        end = len(chunk) if last else (int(cuts[-1]) if len(cuts) else 0)
        bounds = np.unique(np.concatenate(([0], cuts[cuts <= end], [end])))
        docs = [chunk[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        keys = (doc_key(d[:-1] if eos is not None and d[-1] == eos else d) for d in docs)
        codes = np.fromiter((SPLIT_CODE[split_of(k, cfg)] for k in keys), dtype=np.int8, count=len(docs))
        lens = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        flat = np.concatenate(docs) if docs else np.zeros(0, dtype=src.dtype)
        writer.add(Encoded(codes, lens, flat, int(flat.nbytes), top))
        carry = chunk[end:]
    return writer.close()
