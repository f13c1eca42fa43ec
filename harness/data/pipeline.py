"""Data: documents → tokenizer → packed fixed-length blocks → disjoint train/eval/calib splits.

Documents are split (not blocks) so no text crosses splits; the split is a seeded hash of
each document, so it is the same on every rank, launcher and world size. Batches are
addressed by (step, micro-batch, rank): the global batch of a step is the same whatever
the world size, which is what makes world 1 and world 2 train identically and makes
resume exact (the data position is just the step).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

from harness.config import DataConfig
from harness.errors import ConfigError

SPLITS = ("train", "eval", "calib")
EOS = "<|endoftext|>"


# ------------------------------------------------------------------------- documents


def embedded_documents(max_chars: int = 3_000_000) -> list[str]:
    """Text every Python installation has: pydoc topics and standard-library sources.

    Sorted and capped, so the corpus is deterministic for a given Python version.
    """
    docs: list[str] = []
    try:
        from pydoc_data.topics import topics

        docs += [topics[k] for k in sorted(topics)]
    except ImportError:  # some distributions strip pydoc_data
        pass
    stdlib = os.path.dirname(os.__file__)
    total = sum(map(len, docs))
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        if total >= max_chars:
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


def load_documents(cfg: DataConfig) -> list[str]:
    """Documents from the embedded corpus, local files (text/jsonl/json/parquet) or a hub dataset."""
    if cfg.source == "embedded":
        return embedded_documents()
    import datasets

    if os.path.exists(cfg.source):
        files = sorted(glob.glob(os.path.join(cfg.source, "**", "*"), recursive=True)) if os.path.isdir(cfg.source) else [cfg.source]
        files = [f for f in files if os.path.isfile(f)]
        if not files:
            raise ConfigError(f"data.source '{cfg.source}' holds no files")
        ext = os.path.splitext(files[0])[1].lower()
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(ext, "text")
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
    else:
        try:
            ds = datasets.load_dataset(cfg.source, split="train")
        except Exception as exc:
            raise ConfigError(f"data.source '{cfg.source}' is not a local path and could not be loaded from the hub "
                              f"({type(exc).__name__})") from None
    if cfg.text_field not in ds.column_names:
        raise ConfigError(f"data.source '{cfg.source}' has no column '{cfg.text_field}' (columns: {', '.join(ds.column_names)}); "
                          "set data.text_field")
    docs = [t for t in ds[cfg.text_field] if isinstance(t, str) and t.strip()]
    if not docs:
        raise ConfigError(f"data.source '{cfg.source}' has no non-empty '{cfg.text_field}' texts")
    return docs


def split_of(doc: str, cfg: DataConfig) -> str:
    h = int.from_bytes(hashlib.sha256(f"{cfg.seed}:{doc}".encode()).digest()[:8], "little") / 2**64
    if h < cfg.eval_fraction:
        return "eval"
    if h < cfg.eval_fraction + cfg.calib_fraction:
        return "calib"
    return "train"


# ------------------------------------------------------------------------- tokenizer


def train_bpe_tokenizer(docs: list[str], vocab_size: int, path: str):
    """A byte-level BPE trained locally (HF `tokenizers`) for models that ship none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(path)
    return fast


def load_tokenizer(model_name: str, cfg: DataConfig, docs: list[str] | None, cache: str):
    from transformers import AutoTokenizer

    if cfg.tokenizer:
        return AutoTokenizer.from_pretrained(cfg.tokenizer)
    if os.path.isdir(model_name) and glob.glob(os.path.join(model_name, "tokenizer*")):
        return AutoTokenizer.from_pretrained(model_name)
    local = os.path.join(cache, "tokenizer")
    if os.path.exists(os.path.join(local, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(local)
    if docs is None:
        raise RuntimeError("tokenizer cache missing")
    return train_bpe_tokenizer(docs, cfg.vocab_size, local)


# ------------------------------------------------------------------------- packed blocks


@dataclass
class PackedData:
    blocks: dict[str, np.ndarray]  # split -> (n_blocks, seq_len) int32
    vocab_size: int
    tokenizer_dir: str | None
    cache_dir: str

    def n_blocks(self, split: str) -> int:
        return int(self.blocks[split].shape[0])


def cache_dir_for(model_name: str, cfg: DataConfig) -> str:
    root = cfg.cache_dir or os.environ.get("HARNESS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "harness")
    key = json.dumps({"data": asdict(cfg) | {"cache_dir": None},
                      "model": model_name if not os.path.isdir(model_name) else os.path.abspath(model_name),
                      "py": sys.version_info[:2]}, sort_keys=True, default=str)
    return os.path.join(root, "data-" + hashlib.sha256(key.encode()).hexdigest()[:16])


def _pack(token_lists: list[list[int]], eos_id: int, seq_len: int) -> np.ndarray:
    flat: list[int] = []
    for ids in token_lists:
        flat.extend(ids)
        flat.append(eos_id)
    n = len(flat) // seq_len
    return np.asarray(flat[: n * seq_len], dtype=np.int32).reshape(n, seq_len)


def prepare_data(model_name: str, cfg: DataConfig) -> str:
    """Tokenize and pack into the cache (idempotent). Run on one rank; others wait, then load."""
    cache = cache_dir_for(model_name, cfg)
    if os.path.exists(os.path.join(cache, "meta.json")):
        return cache
    os.makedirs(cache, exist_ok=True)
    docs = load_documents(cfg)
    tok = load_tokenizer(model_name, cfg, [d for d in docs if split_of(d, cfg) == "train"], cache)
    eos_id = tok.eos_token_id if tok.eos_token_id is not None else 0
    by_split: dict[str, list[str]] = {s: [] for s in SPLITS}
    for doc in docs:
        by_split[split_of(doc, cfg)].append(doc)
    budget = {"train": cfg.max_tokens, "eval": None, "calib": None}
    for split in SPLITS:
        ids: list[list[int]] = []
        used = 0
        for doc in by_split[split]:
            toks = tok(doc, add_special_tokens=False)["input_ids"]
            ids.append(toks)
            used += len(toks) + 1
            if budget[split] is not None and used >= budget[split]:
                break
        arr = _pack(ids, eos_id, cfg.seq_len)
        if arr.shape[0] == 0:
            raise ConfigError(f"data.source '{cfg.source}': the {split} split has fewer than seq_len={cfg.seq_len} tokens")
        np.save(os.path.join(cache, f"{split}.npy"), arr)
    tok_dir = os.path.join(cache, "tokenizer")
    if not os.path.isdir(tok_dir):
        tok.save_pretrained(tok_dir)
    meta = {"vocab_size": len(tok), "seq_len": cfg.seq_len}
    tmp = os.path.join(cache, "meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, os.path.join(cache, "meta.json"))  # written last: marks the cache complete
    return cache


def load_packed(cache: str) -> PackedData:
    with open(os.path.join(cache, "meta.json")) as f:
        meta = json.load(f)
    blocks = {s: np.load(os.path.join(cache, f"{s}.npy"), mmap_mode="r") for s in SPLITS}
    return PackedData(blocks, int(meta["vocab_size"]), os.path.join(cache, "tokenizer"), cache)


# ------------------------------------------------------------------------- batches


class BatchSampler:
    """Deterministic global order of training blocks; each rank takes its slice.

    Global sample index i of the run maps to epoch i // n and position i % n of that
    epoch's seeded permutation. Step s, micro-batch a, rank r reads the `micro` samples
    starting at s*G + (a*world + r)*micro, with G = micro*accum*world.
    """

    def __init__(self, data: PackedData, micro: int, accum: int, world: int, rank: int, seed: int):
        self.train = data.blocks["train"]
        self.micro, self.accum, self.world, self.rank, self.seed = micro, accum, world, rank, seed
        self.n = self.train.shape[0]
        self._perms: dict[int, np.ndarray] = {}

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._perms[epoch]

    def batch(self, step: int, micro_index: int) -> torch.Tensor:
        start = step * self.global_batch + (micro_index * self.world + self.rank) * self.micro
        rows = []
        for i in range(start, start + self.micro):
            rows.append(self.train[self._perm(i // self.n)[i % self.n]])
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def split_batches(data: PackedData, split: str, micro: int, max_batches: int, world: int, rank: int) -> Iterator[torch.Tensor]:
    """The first `max_batches * micro` blocks of a fixed split, strided over ranks."""
    arr = data.blocks[split]
    total = min(arr.shape[0], max_batches * micro)  # global: the same blocks at any world size
    total -= total % world  # every rank runs the same number of forwards (sharded engines gather in them)
    mine = np.arange(rank, total, world)
    for i in range(0, len(mine), micro):
        idx = mine[i : i + micro]
        if len(idx):
            yield torch.from_numpy(np.asarray(arr[idx]).astype(np.int64))
