"""The tokenized cache: prepared once, flat on disk, with memory flat in the corpus size.

    <cache root>/data-<key>/
      meta.json              written last (the directory is renamed into place after it): complete
      train.bin eval.bin calib.bin        each split's token stream, EOS after every document,
                                          uint16 when the vocabulary fits, else uint32
      train.docs.npy ...     where each document starts in its split's stream (int64)
      tokenizer/             the tokenizer the streams were made with

Tokenization runs in `data.num_proc` processes, each encoding a batch of documents with the
fast tokenizer's batch call; the parent writes the results in document order, so the
streams (and the blocks cut from them) are the same whatever the process count. Nothing
holds the corpus in memory: documents are read from memory-mapped Arrow, tokens go
straight to the files, blocks are memory-mapped views of them.

One preparation per cache: whoever takes `<cache>.lock` (`harness.distributed.FileLock`)
prepares into `<cache>.tmp-<host>-<pid>` and renames it into place; everyone else waits
(saying for whom) until `meta.json` exists. A lock whose owner died is taken over and the
dead owner's temporary directory removed, never trusted. On a shared file
system that is one preparation for the whole cluster; on local disks, one per node.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from harness.config import INSTRUCTION_FORMATS, DataConfig, is_preset
from harness.data import tokens as tokenization
from harness.data.blocks import BosBlocks
from harness.data.documents import (
    EMBEDDED_SOURCES,
    SPLITS,
    check_columns,
    data_files,
    is_token_file,
    open_documents,
    open_stream,
    pretokenized,
)
from harness.data.folders import check_arrow_files, folder_layout, open_folder
from harness.data.instructions import EXAMPLES, LAYOUT_VERSION, load_examples, prepare_instructions
from harness.data.integrity import cache_problem, check_cache_root, source_fingerprint
from harness.data.tokenizer import eos_id, given_tokenizer, saved_bos, train_bpe_tokenizer
from harness.distributed import FileLock
from harness.errors import ConfigError, StopRequested
from harness.log import ALL_RANKS, get_logger

if TYPE_CHECKING:
    import datasets

log = get_logger(__name__)
FORMAT = 2
DOCS_PER_TASK = 1000  # documents per tokenizer batch in the pool
DOCS_PER_STEP_IN_PROCESS = 128  # smaller in one process: a capped train split stops tokenizing sooner


@dataclass
class PackedData:
    blocks: dict[str, Any]  # split -> (n_blocks, seq_len) memory-mapped view of its token stream (or `BosBlocks` over it)
    vocab_size: int
    tokenizer_dir: str | None
    cache_dir: str
    tokens: dict[str, int]  # tokens in each split's stream (the blocks use all but the last partial block)

    def n_blocks(self, split: str) -> int:
        return int(self.blocks[split].shape[0])


def cache_dir_for(model_name: str, cfg: DataConfig) -> str:
    root = cfg.cache_dir or os.environ.get("HARNESS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "harness")
    content = asdict(cfg) | {"cache_dir": None, "num_proc": None}  # neither changes what is written
    del content["block_bos"]  # decided when the blocks are cut from the streams, not written
    if cfg.format == "text":  # keys added with instruction data: text caches keep the names they had before
        del content["format"], content["packing"]
        if cfg.tokenizer or not is_preset(model_name):  # caches that keep a given tokenizer's BOS (`leading_specials`)
            content["specials"] = "leading"
    else:
        content["layout"] = LAYOUT_VERSION
    if cfg.source not in EMBEDDED_SOURCES and os.path.exists(cfg.source):
        content["source_files"] = source_fingerprint(cfg.source)  # a corpus edited in place is read again
    key = json.dumps(
        {
            "format": FORMAT,
            "data": content,
            "model": model_name if not os.path.isdir(model_name) else os.path.abspath(model_name),
            "py": sys.version_info[:2],
        },
        sort_keys=True,
        default=str,
    )
    return os.path.join(root, "data-" + hashlib.sha256(key.encode()).hexdigest()[:16])


def is_complete(cache: str) -> bool:
    """meta.json (written last) is there and every file it lists has the size it was written with."""
    return os.path.isfile(os.path.join(cache, "meta.json")) and not cache_problem(cache)


def default_num_proc() -> int:
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 16))


# ----------------------------------------------------------------------------- preparing once


def prepare_data(model_name: str, cfg: DataConfig, progress: bool = True) -> str:
    """The complete cache for (model, data config): prepared here under the lock, or waited for."""
    cache = cache_dir_for(model_name, cfg)
    lock = FileLock(cache + ".lock", what="preparing a data cache")
    waited_since, said = time.monotonic(), 0.0
    if is_complete(cache):  # a prepared cache is read, even from a read-only directory
        return cache
    check_cache_root(cache)
    while not is_complete(cache):
        if lock.try_acquire():
            try:
                if not is_complete(cache):
                    _prepare_locked(model_name, cfg, cache, progress)
            finally:
                lock.release()
            break
        dead = lock.dead_owner()
        if dead is not None:
            if lock.take_over(dead):
                log.warning(f"data cache {cache}: its preparer ({lock.describe(dead)}) stopped; preparing it again")
            continue
        now = time.monotonic()
        check_stop("waiting for another process preparing")
        if now - said >= 60.0 and os.environ.get("LOCAL_RANK", "0") == "0":
            log.info(
                f"waiting for {lock.describe()} to finish preparing the data cache {cache} ({now - waited_since:.0f} s so far)",
                extra=ALL_RANKS,
            )
            said = now
        time.sleep(1.0)
    return cache


# ----------------------------------------------------------------------------- preparation


def _prepare_locked(model_name: str, cfg: DataConfig, cache: str, progress: bool) -> None:
    parent, name = os.path.split(cache)
    for leftover in os.listdir(parent):  # a dead preparer's half-written directory: never trusted
        if leftover.startswith(name + ".tmp-"):
            shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)
    if os.path.exists(cache):  # incomplete (no meta.json, from before atomic preparation) or damaged since
        problem = cache_problem(cache) if os.path.isfile(os.path.join(cache, "meta.json")) else ""
        if problem:
            log.warning(f"data cache {cache} is damaged ({problem}); preparing it again")
        shutil.rmtree(cache)
    tmp = f"{cache}.tmp-{socket.gethostname()}-{os.getpid()}"
    log.info(f"preparing the data cache {cache} from {cfg.source}")
    os.makedirs(tmp)
    try:
        done = _build(model_name, cfg, tmp, progress)
    except UnicodeDecodeError as exc:  # bytes past pre-flight's sample (the loaders defer decoding)
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"data.source '{cfg.source}' is not UTF-8 text ({exc.reason} at byte {exc.start} of a record); convert it to UTF-8"
        ) from None
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"the data cache {cache} could not be written ({exc.strerror or exc}); free space or set data.cache_dir to a writable directory"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed preparation leaves nothing behind
        raise
    os.rename(tmp, cache)
    log.info(f"{done} -> {cache}")


def _build(model_name: str, cfg: DataConfig, tmp: str, progress: bool) -> str:
    """Write the whole cache into `tmp` (meta.json last); returns what was prepared, in words."""
    t0 = time.perf_counter()
    if cfg.streaming:
        stats = _prepare_stream(model_name, cfg, tmp)
        tok = stats.pop("tokenizer")
    elif cfg.format in INSTRUCTION_FORMATS:  # (input_ids, labels) blocks, loss on the responses only
        stats = prepare_instructions(model_name, cfg, tmp)
        tok = stats.pop("tokenizer")
    elif is_token_file(cfg.source):
        tok = given_tokenizer(model_name, cfg)
        stats = tokenization.split_token_file(cfg, tmp, eos_id(tok, cfg) if tok is not None or cfg.eos_id is not None else None)
    else:
        stats = _tokenize_corpus(model_name, cfg, tmp, progress)
        tok = stats.pop("tokenizer")
    vocab = len(tok) if tok is not None else cfg.vocab_size
    if stats["max_id"] >= vocab:
        raise ConfigError(
            f"data.source '{cfg.source}': token ids reach {stats['max_id']} but the vocabulary has {vocab}; "
            "set data.vocab_size (or data.tokenizer) to match the data"
        )
    # Only training needs a block: an eval split too small for one means no evaluation (the run says
    # so, `harness.runner.build`), a calib split too small is refused by the pruning that reads it.
    if not cfg.streaming and stats["tokens"]["train"] < cfg.seq_len:
        raise ConfigError(
            f"data.source '{cfg.source}': the train split has {stats['tokens']['train']} tokens, fewer than "
            f"seq_len={cfg.seq_len}; give more data or lower data.seq_len"
        )
    if tok is not None:
        tok.save_pretrained(os.path.join(tmp, "tokenizer"))
    meta = {
        "format": FORMAT,
        "vocab_size": vocab,
        "seq_len": cfg.seq_len,
        "dtype": stats["dtype"],
        "tokens": stats["tokens"],
        "documents": stats["documents"],
        "bytes": stats["bytes"],
        "seconds": time.perf_counter() - t0,
        "source": cfg.source,
    }
    if "layout" in stats:  # instruction blocks: <split>.examples.npy, and how many tokens carry a label
        meta.update(layout=stats["layout"], labelled=stats["labelled"])
    meta["files"] = {
        os.path.relpath(os.path.join(d, n), tmp): os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(tmp) for n in names
    }  # the manifest `cache_problem` checks: a truncated file is prepared again, not read as garbage
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return (
        f"data: {sum(stats['tokens'].values()):,} tokens ({', '.join(f'{s} {n:,}' for s, n in stats['tokens'].items())}) "
        f"from {stats['bytes'] / 2**20:,.1f} MiB in {meta['seconds']:.1f}s"
    )


DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # a write refused for room, not for the data


def _read_corpus(cfg: DataConfig) -> datasets.Dataset:
    """The documents; a source the loaders cannot read (an undecodable line, broken JSON or
    parquet) is one line naming it, not a loader's traceback on every rank."""
    try:
        layout = folder_layout(cfg.source) if cfg.source not in EMBEDDED_SOURCES else None
        if layout is None:
            if os.path.exists(cfg.source):
                check_arrow_files([f for f in data_files(cfg.source) if f.endswith(".arrow")])
            return open_documents(cfg)
        ds = open_folder(cfg.source, layout, cfg)
        check_columns(ds.column_names, cfg)
        return ds
    except ConfigError:
        raise
    except Exception as exc:
        cause = exc.__cause__ or exc.__context__ or exc
        if isinstance(cause, OSError) and cause.errno in DISK_FULL:  # the datasets library converts files into its own cache
            import datasets

            raise ConfigError(
                f"data.source '{cfg.source}' could not be converted: the datasets cache {datasets.config.HF_DATASETS_CACHE} "
                f"could not be written ({cause.strerror or cause}); free space or set HF_DATASETS_CACHE to a writable directory"
            ) from None
        raise ConfigError(
            f"data.source '{cfg.source}' could not be read ({type(cause).__name__}: "
            f"{(str(cause).splitlines() or [''])[0][:200]}); fix or remove the file"
        ) from None


def _tokenize_corpus(model_name: str, cfg: DataConfig, out: str, progress: bool) -> dict[str, Any]:
    ds = _read_corpus(cfg)
    pretok = pretokenized(ds.column_names, cfg)
    tok = given_tokenizer(model_name, cfg)
    if tok is None and not pretok:
        tok = train_bpe_tokenizer(tokenization.train_text_batches(ds, cfg), cfg.vocab_size, os.path.join(out, "tokenizer"))
    if pretok and tok is None and cfg.eos_id is None:
        raise ConfigError(
            f"data.source '{cfg.source}' is pre-tokenized (input_ids) and no tokenizer names its end-of-document "
            "token; set data.eos_id (or data.tokenizer)"
        )
    vocab = len(tok) if tok is not None else cfg.vocab_size
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    work = tokenization.Work(ds, tok, cfg, eos_id(tok, cfg), dtype, pretok)
    writer = tokenization.SplitWriter(out, dtype, cfg.max_tokens)
    tasks = [(start, min(start + DOCS_PER_TASK, len(ds))) for start in range(0, len(ds), DOCS_PER_TASK)]
    total_bytes = _input_bytes(ds, cfg)
    bar = tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="tokenizing",
        disable=not progress,
        mininterval=1.0 if sys.stderr.isatty() else 15.0,
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    try:
        for result in _run(work, tasks, cfg.num_proc or default_num_proc(), writer):
            writer.add(result)
            bar.update(result.nbytes)
            bar.set_postfix_str(f"{writer.total_tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s", refresh=False)
    finally:
        bar.close()
    return {**writer.close(), "tokenizer": tok}


def _prepare_stream(model_name: str, cfg: DataConfig, out: str) -> dict[str, Any]:
    """`data.streaming`: the cache holds the tokenizer and the eval/calib blocks only (read from
    the start of the stream, the same for every rank); training reads the stream itself."""
    tok = given_tokenizer(model_name, cfg)
    if tok is None:
        tok = train_bpe_tokenizer(tokenization.train_text_batches(open_stream(cfg), cfg), cfg.vocab_size, os.path.join(out, "tokenizer"))
    dtype = np.uint16 if len(tok) <= 2**16 else np.uint32
    writer = tokenization.SplitWriter(out, dtype, max_tokens=0)  # no train blocks in the cache
    want = cfg.stream_eval_blocks * cfg.seq_len
    for texts in tokenization.text_batches(open_stream(cfg), cfg, batch=256):
        writer.add(tokenization.encode_texts(texts, tok, cfg, eos_id(tok, cfg), dtype, skip_train=True))
        if writer.tokens["eval"] >= want and (writer.tokens["calib"] >= want or not cfg.calib_fraction):
            break
    return {**writer.close(), "tokenizer": tok}


def _input_bytes(ds: datasets.Dataset, cfg: DataConfig) -> int | None:
    """The corpus size for the progress bar: the Arrow data's size (None when unknown)."""
    with contextlib.suppress(Exception):
        return int(ds.data.nbytes)
    return None


def _run(
    work: tokenization.Work, tasks: list[tuple[int, int]], num_proc: int, writer: tokenization.SplitWriter
) -> Iterator[tokenization.Encoded]:
    """Encoded batches in document order: in this process for small corpora, else in a pool
    with at most 2 x num_proc batches in flight (so memory stays flat)."""
    if num_proc == 1 or len(tasks) < 4 or "fork" not in mp.get_all_start_methods():
        for start, end in tasks:
            for step in range(start, end, DOCS_PER_STEP_IN_PROCESS):
                yield tokenization.encode(work, (step, min(step + DOCS_PER_STEP_IN_PROCESS, end)), writer.train_full)
                check_stop("tokenizing")
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one tokenizer thread per process; the processes are the parallelism
    tokenization.WORK = work  # inherited by the forked workers
    ctx = mp.get_context("fork")
    with ctx.Pool(num_proc, initializer=_worker_signals) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(tokenization.encode_inherited, (task, writer.train_full)))
            while len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
                check_stop("tokenizing")
        while pending:
            yield pending.popleft().get()
            check_stop("tokenizing")
    tokenization.WORK = None


def _worker_signals() -> None:
    """A tokenizer worker does not inherit the run's stop handlers (which only set a flag): SIGTERM
    ends it (the pool's terminate), Ctrl-C is the parent's to act on, not every worker's."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


_STOP: list[Callable[[], bool]] = []  # the run's "a stop was requested" predicate (`stop_preparation_when`)


def stop_preparation_when(requested: Callable[[], bool]) -> None:
    """Make a preparation (or a wait for another's) stop when `requested()` turns true: a stop
    signal during data preparation ends it within a batch, its temporary directory removed."""
    _STOP[:] = [requested]


def check_stop(doing: str) -> None:
    if _STOP and _STOP[0]():
        raise StopRequested(f"stop requested while {doing} the data cache; nothing was written and there is no step to save yet")


# ----------------------------------------------------------------------------- loading


def load_packed(cache: str, block_bos: bool = True) -> PackedData:
    """The cache's blocks; `block_bos`: where its tokenizer puts a BOS before every text, every
    text block starts with one (`harness.data.blocks`)."""
    with open(os.path.join(cache, "meta.json")) as f:
        meta = json.load(f)
    seq, dtype = int(meta["seq_len"]), np.dtype(meta["dtype"])
    tok_dir = os.path.join(cache, "tokenizer")
    blocks = load_examples(cache) if meta.get("layout") == EXAMPLES else {}
    bos = saved_bos(tok_dir) if block_bos and not blocks else None
    for split in SPLITS if not blocks else ():
        n = int(meta["tokens"][split]) // seq
        path = os.path.join(cache, f"{split}.bin")
        if bos is not None and int(meta["tokens"][split]):
            blocks[split] = BosBlocks(np.memmap(path, dtype=dtype, mode="r"), seq, bos)
        else:
            blocks[split] = np.memmap(path, dtype=dtype, mode="r", shape=(n, seq)) if n else np.zeros((0, seq), dtype=dtype)
    if bos is not None:
        train = blocks["train"]
        log.info(
            f"data: the tokenizer puts BOS (id {bos}) before every text: every block starts with it "
            f"({getattr(train, 'gained', 0):,} of {len(train):,} train blocks gained one); data.block_bos=false turns this off"
        )
    return PackedData(
        blocks, int(meta["vocab_size"]), tok_dir if os.path.isdir(tok_dir) else None, cache, {s: int(meta["tokens"][s]) for s in SPLITS}
    )
