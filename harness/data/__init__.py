"""Data: documents from the embedded corpus, files or the hub; tokenized, packed into blocks,
split by document (train/eval/calib) and sampled identically at any world size."""
from harness.data.pipeline import (
    EOS,
    SPLITS,
    BatchSampler,
    PackedData,
    cache_dir_for,
    embedded_documents,
    load_documents,
    load_packed,
    load_tokenizer,
    prepare_data,
    split_batches,
    split_of,
)

__all__ = ["EOS", "SPLITS", "BatchSampler", "PackedData", "cache_dir_for", "embedded_documents", "load_documents", "load_packed",
           "load_tokenizer", "prepare_data", "split_batches", "split_of"]
