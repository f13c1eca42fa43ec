"""The tokenizer of a run: the one given (`data.tokenizer`), the model's own, or a byte-level
BPE trained locally on the train split and cached with the data."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from harness.config import DataConfig
from harness.data.documents import EOS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BPE_TRAINING_CHARS = 50_000_000  # a BPE vocabulary settles long before this; more only costs memory and time


def train_bpe_tokenizer(batches: Iterable[list[str]], vocab_size: int, path: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained locally (HF `tokenizers`) for models that ship none; at most
    `BPE_TRAINING_CHARS` characters of the given batches are read."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_capped(batches, BPE_TRAINING_CHARS), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(path)
    return fast


def _capped(batches: Iterable[list[str]], max_chars: int) -> Iterator[str]:
    seen = 0
    for batch in batches:
        for text in batch:
            if seen >= max_chars:
                return
            seen += len(text)
            yield text


def has_own_tokenizer(model_name: str) -> bool:
    """A model directory that ships its tokenizer (read instead of training one)."""
    return os.path.isdir(model_name) and bool(glob.glob(os.path.join(model_name, "tokenizer*")))


def given_tokenizer(model_name: str, cfg: DataConfig) -> PreTrainedTokenizerFast | None:
    """`data.tokenizer`, else the model directory's own tokenizer, else None (train one)."""
    from transformers import AutoTokenizer  # lazily, see harness.data.documents

    if cfg.tokenizer:
        return AutoTokenizer.from_pretrained(cfg.tokenizer)
    if has_own_tokenizer(model_name):
        return AutoTokenizer.from_pretrained(model_name)
    return None


def eos_id(tok: PreTrainedTokenizerFast | None, cfg: DataConfig) -> int:
    if tok is not None and tok.eos_token_id is not None:
        return int(tok.eos_token_id)
    return int(cfg.eos_id) if cfg.eos_id is not None else 0


def leading_specials(tok: Any) -> list[int]:
    """The ids the tokenizer puts before every text (a BOS), which `add_special_tokens=False`
    drops: a model trained with BOS on every sequence degrades several-fold without it."""
    full, plain = tok("a")["input_ids"], tok("a", add_special_tokens=False)["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return list(full[:k])
    return []


def saved_bos(directory: str) -> int | None:
    """The BOS a saved tokenizer (`tokenizer.json`) puts before every text, else None; read with
    `tokenizers` alone, so a run whose cache is ready loads no tokenizer class for it."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    tok = Tokenizer.from_file(path)
    full, plain = tok.encode("a").ids, tok.encode("a", add_special_tokens=False).ids
    lead = full[: len(full) - len(plain)] if full[len(full) - len(plain) :] == plain else []
    return lead[0] if len(lead) == 1 else None


def load_tokenizer(directory: str) -> Any:
    """The tokenizer saved in a directory (a cache's, a model's)."""
    from transformers import AutoTokenizer  # lazily, see harness.data.documents

    return AutoTokenizer.from_pretrained(directory)
