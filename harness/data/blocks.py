"""Training blocks cut from a token stream, each starting with the tokenizer's BOS.

A model pretrained with a BOS before every sequence degrades several-fold on a block that starts
mid-document without one (and fine-tuning then trains it where it never was). Where the tokenizer
puts a BOS before every text (`data.block_bos`, on by default), a block that does not already start
with the BOS of a document gets one put before it: `seq_len - 1` stream tokens after it. The stream
is unchanged and read once, in order: every token is in exactly one block, predicted from the same
text before it in its block, so the labels of the real tokens are those of the stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def cut(stream: np.ndarray, at: int, seq_len: int, bos: int) -> tuple[np.ndarray, int]:
    """The block starting at stream position `at`, and how many stream tokens it took."""
    if stream[at] == bos:
        return np.asarray(stream[at : at + seq_len]), seq_len
    return np.concatenate(([bos], np.asarray(stream[at : at + seq_len - 1]))).astype(stream.dtype, copy=False), seq_len - 1


STARTS_PER_READ = 256  # block starts looked at per read of the stream


def block_starts(stream: np.ndarray, seq_len: int, bos: int) -> np.ndarray:
    """Where each whole block starts in the stream (the last partial block is left out, as without BOS).

    Blocks step `seq_len - 1` tokens until one starts on a document's own BOS (it takes `seq_len`);
    the candidates are read `STARTS_PER_READ` at a time, so a corpus of billions of tokens costs
    seconds, not a Python step per block."""
    n, step, at = len(stream), seq_len - 1, 0
    found: list[np.ndarray] = []
    while at < n:
        candidates = np.arange(at, min(n, at + STARTS_PER_READ * step), step, dtype=np.int64)
        on_bos = np.flatnonzero(np.asarray(stream[candidates]) == bos)
        if not on_bos.size:
            found.append(candidates)
            at = int(candidates[-1]) + step
            continue
        found.append(candidates[: on_bos[0] + 1])
        at = int(candidates[on_bos[0]]) + seq_len
    starts = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    lengths = np.where(np.asarray(stream[starts]) == bos, seq_len, step)
    return starts[starts + lengths <= n]


class BosBlocks:
    """A split's blocks as a read-only `(n, seq_len)` array-like over its memory-mapped stream:
    indexed by a row, a slice or an array of rows (what the samplers and evaluation do)."""

    def __init__(self, stream: np.ndarray, seq_len: int, bos: int):
        self.stream, self.seq_len, self.bos = stream, seq_len, bos
        self.starts = block_starts(stream, seq_len, bos)
        self.shape = (len(self.starts), seq_len)
        self.dtype = stream.dtype

    @property
    def gained(self) -> int:
        """How many blocks got a BOS put before them (the others start with a document's own)."""
        return int(np.count_nonzero(np.asarray(self.stream[self.starts]) != self.bos)) if len(self.starts) else 0

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        if isinstance(index, int | np.integer):
            return cut(self.stream, int(self.starts[index]), self.seq_len, self.bos)[0]
        rows = np.arange(len(self))[index]
        out = np.empty((len(rows), self.seq_len), dtype=self.dtype)
        for k, row in enumerate(rows):
            out[k] = cut(self.stream, int(self.starts[row]), self.seq_len, self.bos)[0]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


__all__ = ["BosBlocks", "block_starts", "cut"]
