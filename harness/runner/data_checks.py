"""Pre-flight's checks of the run's data source: that it exists, is one kind of file, decodes as
UTF-8, holds the records its format needs, and (a token file) is a whole array of integers; each
problem one line before any process group starts. Called by `harness.runner.preflight`."""

from __future__ import annotations

import codecs
import json
import os
from typing import Any

import numpy as np
from huggingface_hub import constants

from harness.config import INSTRUCTION_FORMATS, DataConfig, RunConfig, is_preset
from harness.data import (
    EMBEDDED_SOURCES,
    cache_dir_for,
    check_arrow_files,
    check_cache_root,
    check_saved_folder,
    data_files,
    folder_layout,
    format_hint,
    has_own_tokenizer,
    is_complete,
    read_records,
)
from harness.errors import ConfigError
from harness.log import get_logger
from harness.runner.inputs import check_tokenizer_dir

log = get_logger(__name__)


def looks_like_path(name: str) -> bool:
    """Whether a model or data name is meant as a local path (a hub id is `owner/name`)."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or name.endswith((".json", ".jsonl", ".txt", ".parquet"))


def offline() -> bool:
    """HF_HUB_OFFLINE set: nothing may come from the Hub."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def vocabulary_problem(model_name: str, rows: Any, data_vocab: int) -> str | None:
    """Why a checkpoint that embeds `rows` tokens cannot read data of `data_vocab` (None: it can)."""
    if not isinstance(rows, int) or data_vocab <= rows:
        return None
    return (
        f"the data's vocabulary has {data_vocab:,} tokens but model.name '{model_name}' embeds {rows:,}: tokenize with "
        f"the model's own tokenizer (data.tokenizer), or, for the embedded corpus, set data.vocab_size <= {rows:,}"
    )


def check_vocabulary(cfg: RunConfig, shape: dict[str, Any]) -> None:
    """A checkpoint without a tokenizer (and no data.tokenizer) reads data tokenized by the
    tokenizer harness trains, of `data.vocab_size` tokens: it must fit the embedding. With a
    tokenizer, its size is checked once it is read (`harness.runner.build.check_tokenized_vocabulary`)."""
    if is_preset(cfg.model.name) or cfg.data.tokenizer or has_own_tokenizer(cfg.model.name):
        return
    rows = shape.get("vocab_size", (shape.get("text_config") or {}).get("vocab_size"))
    if (problem := vocabulary_problem(cfg.model.name, rows, cfg.data.vocab_size)) is not None:
        raise ConfigError(problem)


def check_data(cfg: RunConfig) -> None:
    source = cfg.data.source
    cache = cache_dir_for(cfg.model.name, cfg.data)
    if not is_complete(cache):  # a prepared cache is read even where nothing can be written
        check_cache_root(cache, create=False)
    if cfg.data.tokenizer and not os.path.exists(cfg.data.tokenizer):
        raise ConfigError(f"data.tokenizer '{cfg.data.tokenizer}' does not exist; give a tokenizer directory or leave it unset")
    if cfg.data.tokenizer and os.path.isdir(cfg.data.tokenizer):
        check_tokenizer_dir(cfg.data.tokenizer, "data.tokenizer")
    elif not cfg.data.tokenizer and os.path.isfile(os.path.join(cfg.model.name, "tokenizer.json")):
        check_tokenizer_dir(cfg.model.name, f"the tokenizer of model.name '{cfg.model.name}'")
    if cfg.data.format in INSTRUCTION_FORMATS:
        read_records(source, cfg.data.format)  # every record must be prompt/response or messages: one line naming the first that is not
        return
    if source in EMBEDDED_SOURCES:
        return
    layout = folder_layout(source)
    if layout is not None:  # a save_to_disk folder, or one laid out as a Hub dataset repository
        if cfg.data.streaming:
            raise ConfigError(f"data.source '{source}' is a datasets folder, read memory-mapped: set data.streaming=false")
        if layout == "saved":
            check_saved_folder(source, cfg.data)
        return
    if os.path.exists(source):
        files = [os.path.join(d, f) for d, _, fs in os.walk(source) for f in fs] if os.path.isdir(source) else [source]
        if not files:
            raise ConfigError(f"data.source '{source}' is an empty directory; put text/jsonl/json/parquet files in it")
        files = data_files(source)  # one kind of file (a README beside them is left out)
        if all(os.path.getsize(f) == 0 for f in files):
            raise ConfigError(f"data.source '{source}' holds only empty files")
        check_decodable(files)
        check_arrow_files([f for f in files if f.endswith(".arrow")])
        first = sorted(files)[0]
        if first.endswith((".npy", ".bin")) and os.path.isfile(source):
            check_token_file(source, cfg.data, cfg.model.name)
            return
        if first.endswith(".jsonl"):
            with open(first) as f:
                line = next((ln for ln in f if ln.strip()), "")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.source file '{first}' is not valid JSON lines (line 1, column {e.colno}: {e.msg})") from None
            if isinstance(record, dict) and cfg.data.text_field not in record and "input_ids" in record:
                if cfg.data.eos_id is None and not cfg.data.tokenizer and not os.path.isdir(cfg.model.name):
                    raise ConfigError(
                        f"data.source '{first}' is pre-tokenized (input_ids) and no tokenizer names its "
                        "end-of-document token; set data.eos_id (or data.tokenizer)"
                    )
            elif isinstance(record, dict) and cfg.data.text_field not in record:
                raise ConfigError(
                    f"data.source '{first}' has no field '{cfg.data.text_field}' (fields: {', '.join(record)}); set data.text_field"
                    + format_hint(list(record))
                )
        return
    if looks_like_path(source):
        raise ConfigError(f"data.source '{source}' does not exist")
    if offline():
        cached = os.path.isdir(os.path.join(constants.HF_HUB_CACHE, "datasets--" + source.replace("/", "--")))
        if not cached:
            raise ConfigError(f"data.source '{source}' is not a local path or a cached hub dataset, and HF_HUB_OFFLINE=1 (no network)")


DECODE_SAMPLE_FILES, DECODE_SAMPLE_BYTES = 200, 1 << 16


def check_decodable(files: list[str]) -> None:
    """Text sources must be UTF-8: the first 64 KiB of (up to 200 of) the files are decoded, so a
    wrong encoding is one line here (the full read during preparation reports the rest)."""
    for path in sorted(files)[:DECODE_SAMPLE_FILES]:
        if path.endswith((".parquet", ".npy", ".bin", ".arrow")):
            continue
        with open(path, "rb") as f:
            head = f.read(DECODE_SAMPLE_BYTES)
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"data.source file '{path}' is not UTF-8 text (byte {exc.start}: {head[exc.start : exc.start + 4]!r}); convert it to UTF-8"
            ) from None


def check_token_file(path: str, data: DataConfig, model_name: str) -> None:
    """A flat token file: integers, one dimension, and (raw .bin) a whole number of elements."""
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as exc:
            raise ConfigError(f"data.source '{path}' is not a readable .npy file ({str(exc).splitlines()[0]})") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ConfigError(
                f"data.source '{path}': a token file must hold one flat array of integer token ids (got {arr.dtype}, shape {arr.shape})"
            )
    elif os.path.getsize(path) % np.dtype(data.token_dtype).itemsize:
        raise ConfigError(f"data.source '{path}' is not a whole number of {data.token_dtype} tokens; check data.token_dtype")
    if data.eos_id is None and not data.tokenizer and not os.path.isdir(model_name):
        log.warning(f"data.source '{path}' gives no end-of-document token (data.eos_id): it is cut into 4,096-token documents")
