"""Text blocks start with the BOS a tokenizer puts before every text (`data.block_bos`), in the
cache's blocks (training and eval) and in streamed training: every stream token in exactly one
block, in order, after the same text as before; said once; off with `data.block_bos=false`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from harness.config import DataConfig
from harness.data import BatchSampler, StreamSampler, embedded_documents, load_packed, prepare_data, split_batches, split_of
from harness.data.tokenizer import leading_specials, train_bpe_tokenizer

SEQ = 32
BOS = "<s>"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, Path]:
    """JSON lines documents and a tokenizer that puts BOS before every text (as Llama's and Gemma's do)."""
    root = tmp_path_factory.mktemp("bos")
    docs = [d[:400] for d in embedded_documents(300_000)]
    tok = train_bpe_tokenizer([docs], 400, str(root / "tok"))
    tok.add_special_tokens({"bos_token": BOS})
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.bos_token_id)])
    tok.save_pretrained(root / "tok")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return root / "docs.jsonl", root / "tok"


def _cfg(source, cache: Path, **kw) -> DataConfig:
    return DataConfig(source=str(source[0]), tokenizer=str(source[1]), seq_len=SEQ, cache_dir=str(cache), eval_fraction=0.2, **kw)


def assert_blocks_cover_the_stream(rows: np.ndarray, stream: np.ndarray, bos: int) -> int:
    """Each row starts with BOS: the stream's own (the row is the next SEQ tokens) or one put before
    the next SEQ - 1 tokens; rows follow the stream without gap or overlap. Returns rows that gained one."""
    at, gained = 0, 0
    for row in rows:
        assert row[0] == bos
        if stream[at] == bos:
            np.testing.assert_array_equal(row, stream[at : at + SEQ])
            at += SEQ
        else:
            np.testing.assert_array_equal(row[1:], stream[at : at + SEQ - 1])
            at, gained = at + SEQ - 1, gained + 1
    assert len(stream) - at < SEQ  # only a last partial block is left out
    return gained


def test_every_cached_block_starts_with_bos_and_covers_the_stream(source, tmp_path, caplog):
    cache = Path(prepare_data("tiny-llama", _cfg(source, tmp_path), progress=False))
    bos = AutoTokenizer.from_pretrained(source[1]).bos_token_id
    meta = json.loads((cache / "meta.json").read_text())
    with caplog.at_level(logging.INFO, logger="harness"):
        data = load_packed(str(cache))
    said = [r.getMessage() for r in caplog.records if "every block starts with it" in r.getMessage()]
    assert len(said) == 1 and "data.block_bos=false" in said[0], said
    for split in ("train", "eval", "calib"):
        stream = np.fromfile(cache / f"{split}.bin", dtype=meta["dtype"])
        rows = np.asarray(data.blocks[split])
        gained = assert_blocks_cover_the_stream(rows, stream, bos)
        assert 0 < gained < len(rows)  # most blocks start mid-document; some at a document's own BOS
        assert data.n_blocks(split) == len(rows)
        if split == "train":
            assert f"({gained:,} of {len(rows):,} train blocks gained one)" in said[0]
    sampler = BatchSampler(data, micro=4, accum=1, world=2, rank=1, seed=0)
    assert (sampler.batch(3, 0)[:, 0] == bos).all()
    for batch, _ in split_batches(data, "eval", micro=3, max_batches=4, world=1, rank=0):
        assert (batch[:, 0] == bos).all()

    plain = load_packed(str(cache), block_bos=False)  # the switch: the stream cut every SEQ tokens, as before
    stream = np.fromfile(cache / "train.bin", dtype=meta["dtype"])
    np.testing.assert_array_equal(np.asarray(plain.blocks["train"]), stream[: len(stream) // SEQ * SEQ].reshape(-1, SEQ))
    assert (np.asarray(plain.blocks["train"])[:, 0] != bos).any()


def test_streamed_blocks_start_with_bos(source, tmp_path):
    cfg = _cfg(source, tmp_path, streaming=True)
    tok = AutoTokenizer.from_pretrained(source[1])
    assert leading_specials(tok) == [tok.bos_token_id]
    sampler = StreamSampler(cfg, tok, tok.eos_token_id, micro=4, accum=2, world=1, rank=0)
    rows = np.concatenate([sampler.batch(step, m).numpy() for step in range(3) for m in range(2)])
    docs = [json.loads(line)["text"] for line in source[0].read_text().splitlines()]
    train = [d for d in docs if split_of(d, cfg) == "train"]
    stream = np.concatenate([[tok.bos_token_id, *ids, tok.eos_token_id] for ids in tok(train, add_special_tokens=False)["input_ids"]])
    at = 0
    for row in rows:  # the same rule as the cache's blocks, on the stream read so far
        assert row[0] == tok.bos_token_id
        own = stream[at] == tok.bos_token_id
        np.testing.assert_array_equal(row[0 if own else 1 :], stream[at : at + (SEQ if own else SEQ - 1)])
        at += SEQ if own else SEQ - 1
    off = StreamSampler(DataConfig(**{**cfg.__dict__, "block_bos": False}), tok, tok.eos_token_id, micro=4, accum=2, world=1, rank=0)
    np.testing.assert_array_equal(off.batch(0, 0).numpy().reshape(-1), stream[: 4 * SEQ])


def test_a_tokenizer_without_bos_keeps_plain_blocks(tiny_data):
    assert isinstance(tiny_data.blocks["train"], np.memmap)


def test_block_starts_follow_the_rule_on_any_stream():
    """Read many starts at a time, the same as one block after another: `seq_len` tokens from a
    document's own BOS, else a BOS and `seq_len - 1` tokens; the last partial block left out."""
    from harness.data.blocks import block_starts

    rng = np.random.default_rng(0)
    for _ in range(300):
        seq, stream = int(rng.integers(2, 40)), rng.integers(0, int(rng.integers(2, 30)), size=int(rng.integers(0, 3000)))
        expected, at = [], 0
        while at < len(stream) and at + (seq if stream[at] == 1 else seq - 1) <= len(stream):
            expected.append(at)
            at += seq if stream[at] == 1 else seq - 1
        np.testing.assert_array_equal(block_starts(stream, seq, 1), expected)
