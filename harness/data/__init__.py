"""Data: documents from the embedded corpus, files, a hub dataset or a flat token file;
tokenized in parallel into a flat on-disk cache, split by document (train/eval/calib) and
sampled identically at any world size; or streamed and tokenized on the fly.

    python -m harness.data --config run.yaml     # prepare the cache ahead of a job
"""

from harness.data.cache import PackedData, cache_dir_for, is_complete, load_packed, prepare_data, stop_preparation_when
from harness.data.documents import EMBEDDED_SOURCES, EOS, SPLITS, data_files, embedded_documents, open_documents, split_of
from harness.data.folders import check_arrow_files, check_saved_folder, folder_layout
from harness.data.formats import format_hint
from harness.data.instructions import read_records
from harness.data.integrity import check_cache_root
from harness.data.sampling import (
    BatchSampler,
    SequenceSlice,
    StreamSampler,
    describe_consumption,
    split_batches,
    unpack_examples,
    unpack_with_origin,
)
from harness.data.tokenizer import eos_id, given_tokenizer, has_own_tokenizer, load_tokenizer

__all__ = [
    "EMBEDDED_SOURCES",
    "EOS",
    "SPLITS",
    "BatchSampler",
    "PackedData",
    "SequenceSlice",
    "StreamSampler",
    "cache_dir_for",
    "check_arrow_files",
    "check_cache_root",
    "check_saved_folder",
    "folder_layout",
    "format_hint",
    "data_files",
    "stop_preparation_when",
    "describe_consumption",
    "embedded_documents",
    "eos_id",
    "given_tokenizer",
    "has_own_tokenizer",
    "is_complete",
    "load_packed",
    "load_tokenizer",
    "open_documents",
    "prepare_data",
    "read_records",
    "split_batches",
    "unpack_examples",
    "unpack_with_origin",
    "split_of",
]
