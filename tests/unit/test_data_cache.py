"""The tokenized cache at size: no silent cap, every token kept, the same streams whatever the
process count, pre-tokenized input, streaming with an exact position, and a statement of
what a run will consume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from harness.config import DataConfig
from harness.data import (
    PackedData,
    StreamSampler,
    describe_consumption,
    embedded_documents,
    load_packed,
    prepare_data,
    split_of,
)
from harness.distributed import FileLock
from harness.errors import ConfigError

SPLITS = ("train", "eval", "calib")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, Path, list[str]]:
    """~6,000 JSON-lines documents (enough for several tokenizer tasks) and a saved tokenizer (the session's)."""
    root = tmp_path_factory.mktemp("corpus")
    base = [d[:600] for d in embedded_documents()]
    docs = [f"copy {k}: {d}" for k in range(8) for d in base][:6000]
    with open(root / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return root / "docs.jsonl", tokenizer_dir, docs


def _cfg(corpus: tuple[Path, Path, list[str]], cache: Path, **kw) -> DataConfig:
    return DataConfig(source=str(corpus[0]), tokenizer=str(corpus[1]), seq_len=32, cache_dir=str(cache), **kw)


@pytest.fixture(scope="module")
def full(corpus, tmp_path_factory) -> PackedData:
    """The whole corpus prepared once with the defaults (no cap), in two tokenizer processes: the
    cache the next three tests check, compare with a one-process preparation, and cap."""
    return load_packed(prepare_data("tiny-llama", _cfg(corpus, tmp_path_factory.mktemp("full"), num_proc=2), progress=False))


def test_no_cap_by_default_and_every_token_kept(corpus, full):
    assert DataConfig().max_tokens is None
    data = full
    tok = AutoTokenizer.from_pretrained(corpus[1])
    expected = dict.fromkeys(SPLITS, 0)
    for doc in corpus[2]:  # one document at a time, the slow obvious way
        expected[split_of(doc, _cfg(corpus, Path(full.cache_dir)))] += len(tok(doc, add_special_tokens=False)["input_ids"]) + 1
    assert data.tokens == expected
    for split in SPLITS:
        assert data.n_blocks(split) == expected[split] // 32
        stream = np.fromfile(Path(data.cache_dir) / f"{split}.bin", dtype=np.uint16)
        assert stream.size == expected[split]
        starts = np.load(Path(data.cache_dir) / f"{split}.docs.npy")
        assert starts[0] == 0 and np.all(stream[starts[1:] - 1] == tok.eos_token_id)  # every document ends in EOS


def test_streams_are_the_same_with_one_or_two_tokenizer_processes(corpus, full, tmp_path):
    one = load_packed(prepare_data("tiny-llama", _cfg(corpus, tmp_path / "a", num_proc=1), progress=False))
    two = full  # num_proc=2
    for split in SPLITS:
        a = (Path(one.cache_dir) / f"{split}.bin").read_bytes()
        assert a and a == (Path(two.cache_dir) / f"{split}.bin").read_bytes()


def test_max_tokens_caps_the_train_split_only(corpus, full, tmp_path):
    capped = load_packed(prepare_data("tiny-llama", _cfg(corpus, tmp_path / "cap", max_tokens=5000), progress=False))
    assert 5000 <= capped.tokens["train"] < 5000 + 1000  # the document that reaches the cap is kept whole
    assert capped.tokens["eval"] == full.tokens["eval"] and capped.tokens["calib"] == full.tokens["calib"]
    head = np.fromfile(Path(full.cache_dir) / "train.bin", dtype=np.uint16)[: capped.tokens["train"]]
    assert np.array_equal(head, np.fromfile(Path(capped.cache_dir) / "train.bin", dtype=np.uint16))


def test_pretokenized_dataset_and_flat_token_file(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 300, size=int(rng.integers(20, 200))).tolist() for _ in range(800)]
    with open(tmp_path / "ids.jsonl", "w") as f:
        for ids in docs:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    cfg = DataConfig(source=str(tmp_path / "ids.jsonl"), seq_len=16, vocab_size=512, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="data.eos_id"):
        prepare_data("tiny-llama", cfg, progress=False)
    cfg = DataConfig(source=str(tmp_path / "ids.jsonl"), seq_len=16, vocab_size=512, eos_id=0, cache_dir=str(tmp_path / "c"))
    data = load_packed(prepare_data("tiny-llama", cfg, progress=False))
    assert sum(data.tokens.values()) == sum(len(d) + 1 for d in docs) and data.vocab_size == 512
    # the same documents as one flat token stream, EOS (0) between them: the same split streams
    flat = np.concatenate([np.asarray([*d, 0], dtype=np.uint16) for d in docs])
    np.save(tmp_path / "tokens.npy", flat)
    cfg2 = DataConfig(source=str(tmp_path / "tokens.npy"), seq_len=16, vocab_size=512, eos_id=0, cache_dir=str(tmp_path / "c2"))
    data2 = load_packed(prepare_data("tiny-llama", cfg2, progress=False))
    assert data2.tokens == data.tokens
    for split in SPLITS:
        assert np.array_equal(np.asarray(data2.blocks[split]), np.asarray(data.blocks[split]))
    too_small = DataConfig(source=str(tmp_path / "tokens.npy"), seq_len=16, vocab_size=100, eos_id=0, cache_dir=str(tmp_path / "c3"))
    with pytest.raises(ConfigError, match="token ids reach"):
        prepare_data("tiny-llama", too_small, progress=False)


def test_stream_resumes_at_the_exact_sample(corpus, tmp_path):
    cfg = DataConfig(source=str(corpus[0]), tokenizer=str(corpus[1]), seq_len=32, streaming=True, cache_dir=str(tmp_path))
    tok = AutoTokenizer.from_pretrained(corpus[1])
    for rank in (0, 1):

        def sampler() -> StreamSampler:
            return StreamSampler(cfg, tok, tok.eos_token_id, micro=2, accum=2, world=2, rank=rank)

        straight = sampler()
        reference = [straight.batch(step, m) for step in range(6) for m in range(2)]
        first = sampler()
        for step in range(3):
            for m in range(2):
                assert np.array_equal(first.batch(step, m), reference[2 * step + m])
        state = first.state_dict()
        resumed = sampler()
        resumed.load_state_dict(state)
        for step in range(3, 6):
            for m in range(2):
                assert np.array_equal(resumed.batch(step, m), reference[2 * step + m])
        with pytest.raises(RuntimeError, match="in order"):
            resumed.batch(9, 0)
    # the two ranks read different parts of the stream
    other = StreamSampler(cfg, tok, tok.eos_token_id, micro=2, accum=2, world=2, rank=1).batch(0, 0)
    assert not np.array_equal(other, StreamSampler(cfg, tok, tok.eos_token_id, micro=2, accum=2, world=2, rank=0).batch(0, 0))


def test_streaming_cache_holds_eval_and_calib_only(corpus, tmp_path):
    cfg = DataConfig(
        source=str(corpus[0]), tokenizer=str(corpus[1]), seq_len=32, streaming=True, stream_eval_blocks=8, cache_dir=str(tmp_path)
    )
    data = load_packed(prepare_data("tiny-llama", cfg, progress=False))
    assert data.tokens["train"] == 0 and data.n_blocks("eval") >= 8 and data.n_blocks("calib") >= 8


def test_consumption_is_stated_and_repeats_are_flagged():
    data = PackedData({"train": np.zeros((100, 32), np.uint16)}, 512, None, "/x", {"train": 3210})
    cfg = DataConfig(seq_len=32)
    line, repeats = describe_consumption(data, cfg, steps=10, global_batch=8, streaming=False)
    assert "3,210 train tokens = 100 blocks of 32; 10 steps x 8 blocks = 80 blocks = 0.80 epochs" in line and not repeats
    line, repeats = describe_consumption(data, cfg, steps=50, global_batch=8, streaming=False)
    assert "4.00 epochs" in line and repeats


def test_a_dead_owners_lock_is_taken_over_once(tmp_path):
    """Two waiters judged the same owner dead; the first removes its lock and a live process
    takes a new one; the second waiter must not remove the new lock."""
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    path = str(tmp_path / "data-x.lock")
    dead = {"host": socket.gethostname(), "pid": int(dead_pid), "started": 1.0, "what": "x"}
    Path(path).write_text(json.dumps(dead))
    first, second, live = FileLock(path), FileLock(path), FileLock(path)
    seen = second.dead_owner()
    assert first.dead_owner() == dead and seen == dead
    assert first.take_over(dead) and not os.path.exists(path)
    assert live.try_acquire()
    assert not second.take_over(seen)  # still holding the dead owner's identity
    assert live.owner()["pid"] == os.getpid() and live.dead_owner() is None
    live.release()
    assert not os.path.exists(path) and not list(tmp_path.glob("*.takeover-*"))
