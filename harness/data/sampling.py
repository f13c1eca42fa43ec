"""Batches: which blocks each rank reads at each step.

Map-style (the cache): batches are addressed by (step, micro-batch, rank), so the global
batch of a step is the same at any world size (world 1 and world 2 train identically) and
resume is exact (the data position is the step). Streaming (`data.streaming`): each rank
reads its own part of the stream in order and packs it into blocks; the position is the
stream's state plus the tokens carried into the next block, saved per rank in checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harness.config import DataConfig, ParallelLayout
from harness.data.blocks import cut
from harness.data.cache import PackedData
from harness.data.documents import SPLIT_CODE, open_stream, split_codes
from harness.data.instructions import IGNORE
from harness.data.tokenizer import leading_specials
from harness.errors import CheckpointError, ConfigError
from harness.log import get_logger

log = get_logger(__name__)
STREAM_DOCS_PER_READ = 64


@dataclass(frozen=True)
class SequenceSlice:
    """Which slice of every sample's sequence a rank trains under sequence parallelism (`parts`
    ranks share each sample; `parts == 1`: the whole sample). Where a rank sits in the world is
    the run's `ParallelLayout`'s: a sequence group reads the samples of one data-parallel rank."""

    index: int = 0
    parts: int = 1

    @classmethod
    def of(cls, layout: ParallelLayout, rank: int) -> tuple[SequenceSlice, int, int]:
        """`rank`'s slice, and its data-parallel (world, rank): what the samplers are given."""
        return cls(layout.sequence_rank(rank), layout.sequence), layout.data, layout.data_rank(rank)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """`batch` ((B, S) text, (B, 2, S) or (B, 3, S) instruction blocks) -> this rank's `(B, 3, L+1)`
        slice of (input_ids, labels, position_ids), L = S / parts: its L tokens and the next
        slice's first one, whose label is the slice's last next-token target (the last slice's is
        padding: label -100). Positions are the whole sequence's. Unchanged when `parts == 1`."""
        if self.parts == 1:
            return batch
        rows = torch.stack([batch, batch], dim=1) if batch.dim() == 2 else batch[:, :2]
        positions = batch[:, 2] if batch.dim() == 3 and batch.shape[1] > 2 else torch.arange(batch.shape[-1]).expand(batch.shape[0], -1)
        full = torch.cat([rows, positions.unsqueeze(1)], dim=1)
        pad = torch.tensor([0, IGNORE, 0], dtype=full.dtype).view(1, 3, 1).expand(full.shape[0], 3, 1)
        full = torch.cat([full, pad], dim=2)
        width = batch.shape[-1] // self.parts
        return full[:, :, self.index * width : (self.index + 1) * width + 1].contiguous()


class BatchSampler:
    """Deterministic global order of training blocks; each rank takes its slice.

    Global sample index i of the run maps to epoch i // n and position i % n of that
    epoch's seeded permutation. Step s, micro-batch a, rank r reads the `micro` samples
    starting at s*G + (a*world + r)*micro, with G = micro*accum*world. World and rank are the
    data-parallel ones; under sequence parallelism `piece` cuts each batch to this rank's slice.
    """

    def __init__(self, data: PackedData, micro: int, accum: int, world: int, rank: int, seed: int, piece: SequenceSlice = SequenceSlice()):
        self.train = data.blocks["train"]
        self.piece = piece
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
        return self.piece(torch.from_numpy(np.stack(rows).astype(np.int64)))


def unpack_examples(batch: torch.Tensor) -> torch.Tensor:
    """Packed instruction blocks `(B, 3, S)` as one example per row: every segment of a block
    (its positions restart at 0) that holds a labelled token becomes a row of its own, padded
    with unlabelled tokens. The same counted targets as the packed blocks, with no other
    example in the row to attend to: what packing must compute. Blocks without positions
    (text, `(B, S)`) are returned as they are."""
    return unpack_with_origin(batch)[0]


def unpack_with_origin(batch: torch.Tensor, every_segment: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`unpack_examples`, and where each of its tokens sits in `batch`: a `(rows, S)` tensor of
    flat indices `block * S + position` into the packed blocks, -1 for a row's padding.
    `every_segment`: keep the segments without a labelled token too (a prompt cut by the block's
    end, the block's tail padding), so that every token of `batch` is in exactly one row: what a
    quantity over all of a batch's tokens (a router's balance) needs, which the loss does not."""
    length = batch.shape[-1]
    in_place = torch.arange(batch.shape[0] * length).view(batch.shape[0], length)  # every token where it is
    if batch.dim() != 3 or batch.shape[1] < 3:
        return batch, in_place
    rows, origins = [], []
    for index, block in enumerate(batch):
        starts = (block[2] == 0).nonzero().flatten().tolist()
        if every_segment and (not starts or starts[0] != 0):
            starts = [0, *starts]  # tokens before the first restart belong to no example: a row of their own
        for a, b in zip(starts, [*starts[1:], length]):
            if not every_segment and not bool((block[1, a + 1 : b] != IGNORE).any()):  # a segment's first label is never a target
                continue
            row = torch.empty_like(block)
            row[0], row[1], row[2] = block[0, b - 1], IGNORE, torch.arange(length)
            row[0, : b - a], row[1, : b - a] = block[0, a:b], block[1, a:b]
            origin = torch.full((length,), -1, dtype=torch.long)
            origin[: b - a] = torch.arange(index * length + a, index * length + b)
            rows.append(row)
            origins.append(origin)
    return (torch.stack(rows), torch.stack(origins)) if rows else (batch, in_place)


def split_batches(
    data: PackedData, split: str, micro: int, max_batches: int, world: int, rank: int, piece: SequenceSlice = SequenceSlice()
) -> Iterator[tuple[torch.Tensor, bool]]:
    """This rank's part of the first `max_batches * micro` blocks of a fixed split (the same global
    set at any world size), strided over ranks, as (batch, counted) pairs. Every rank runs the same
    number of forwards (sharded engines gather in them): a rank with fewer blocks gets filler
    batches (`counted` False: a copy of the split's first block, whose result must be discarded).
    World and rank are the data-parallel ones; `piece`: this rank's slice of each sample."""
    arr = data.blocks[split]
    total = min(arr.shape[0], max_batches * micro)
    mine = np.arange(rank, total, world)
    forwards = math.ceil(math.ceil(total / world) / micro)  # what the rank with the most blocks runs
    for i in range(forwards):
        idx = mine[i * micro : (i + 1) * micro]
        counted = len(idx) > 0
        yield piece(torch.from_numpy(np.asarray(arr[idx if counted else [0]]).astype(np.int64))), counted


class StreamSampler:
    """Training blocks tokenized on the fly from this rank's part of the stream, in order.

    `batch(step, micro)` must be asked in training order; `state_dict()` is the exact position
    (the dataset's own state and the tokens read but not yet batched).
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Any,
        eos: int,
        micro: int,
        accum: int,
        world: int,
        rank: int,
        piece: SequenceSlice = SequenceSlice(),
    ):
        self.cfg, self.tok, self.eos, self.piece = cfg, tokenizer, eos, piece
        self.prefix = leading_specials(tokenizer)  # a BOS the tokenizer puts before every text
        self.bos = self.prefix[0] if cfg.block_bos and len(self.prefix) == 1 else None  # every block starts with it
        self.micro, self.accum, self.world, self.rank = micro, accum, world, rank
        from datasets.distributed import split_dataset_by_node  # lazily, see harness.data.documents

        self.ds = split_dataset_by_node(open_stream(cfg), rank=rank, world_size=world)
        self.epoch = 0
        self.buffer = np.zeros(0, dtype=np.int64)
        self.position = 0  # micro-batches handed out
        self._it: Iterator[dict[str, Any]] | None = None

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def _read(self) -> None:
        if self._it is None:
            self._it = iter(self.ds)
        texts: list[str] = []
        while len(texts) < STREAM_DOCS_PER_READ:
            try:
                example = next(self._it)
            except UnicodeDecodeError as exc:  # bytes past pre-flight's sample: one line, not a traceback mid-run
                raise ConfigError(
                    f"data.source '{self.cfg.source}' is not UTF-8 text ({exc.reason} at byte {exc.start} of a record); convert it to UTF-8"
                ) from None
            except StopIteration:
                if texts:
                    break
                self.epoch += 1
                log.warning(f"data: rank {self.rank} read its whole part of the stream; epoch {self.epoch} repeats it")
                self.ds.set_epoch(self.epoch)
                self._it = iter(self.ds)
                continue
            text = example.get(self.cfg.text_field)
            if isinstance(text, str) and text.strip():
                texts.append(text)
        train = [t for t, c in zip(texts, split_codes(texts, self.cfg)) if c == SPLIT_CODE["train"]]
        if train:
            ids = self.tok(train, add_special_tokens=False)["input_ids"]
            self.buffer = np.concatenate([self.buffer, *(np.asarray([*self.prefix, *x, self.eos], dtype=np.int64) for x in ids)])

    def batch(self, step: int, micro_index: int) -> torch.Tensor:
        wanted = step * self.accum + micro_index
        if wanted != self.position:
            raise RuntimeError(f"a streamed batch is read in order: asked for micro-batch {wanted}, next is {self.position}")
        seq, rows = self.cfg.seq_len, []
        for _ in range(self.micro):
            while self.buffer.size < seq:
                self._read()
            row, took = cut(self.buffer, 0, seq, self.bos) if self.bos is not None else (self.buffer[:seq], seq)
            rows.append(row)
            self.buffer = self.buffer[took:]
        self.position += 1
        return self.piece(torch.from_numpy(np.stack(rows).astype(np.int64)))

    def state_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.ds.state_dict(),
            "buffer": self.buffer.copy(),
            "epoch": self.epoch,
            "position": self.position,
            "world": self.world,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["world"] != self.world:
            raise CheckpointError(
                f"a streamed run resumes at the world size it was saved at ({state['world']}), not {self.world}: "
                "each rank's position is in its own part of the stream"
            )
        self.epoch = int(state["epoch"])
        self.ds.set_epoch(self.epoch)
        self.ds.load_state_dict(state["dataset"])
        self.buffer = np.asarray(state["buffer"], dtype=np.int64)
        self.position = int(state["position"])
        self._it = None


def describe_consumption(data: PackedData, cfg: DataConfig, steps: int, global_batch: int, streaming: bool) -> tuple[str, bool]:
    """What the configured steps will read, and whether that repeats training data."""
    blocks = steps * global_batch
    if streaming:
        return (
            f"data: streaming; {steps} steps x {global_batch} blocks of {cfg.seq_len} tokens = {blocks * cfg.seq_len:,} "
            "train tokens will be read on the fly",
            False,
        )
    have = data.n_blocks("train")
    epochs = blocks / max(have, 1)
    capped = f" (capped by data.max_tokens={cfg.max_tokens:,})" if cfg.max_tokens is not None else ""
    line = (
        f"data: {data.tokens['train']:,} train tokens{capped} = {have:,} blocks of {cfg.seq_len}; {steps} steps x "
        f"{global_batch} blocks = {blocks:,} blocks = {epochs:.2f} epochs"
    )
    return line, epochs > 1.0
