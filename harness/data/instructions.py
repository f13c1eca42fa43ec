"""Instruction data (`data.format: instruction`): JSON lines of prompt/response pairs or chat
`messages`, tokenized into blocks that carry their own labels, loss on the response only.

Each block is a pair of rows, `(input_ids, labels)`, stored as one `(n, 2, seq_len)` int32
array per split (`<split>.pairs.npy`, memory-mapped). Labels are the token ids where the
model must learn to answer and -100 on prompt tokens and padding, so the ordinary causal-LM
loss (`harness.training.labelled_lm_loss`) counts response tokens only. The samplers,
checkpoints and resume treat these blocks like any other (a block is a row of the array),
so world-size invariance and exact resume hold unchanged.

- `{"prompt": ..., "response": ...}`: prompt tokens, then response tokens and EOS (labelled).
- `{"messages": [{"role": ..., "content": ...}, ...]}`: rendered with the tokenizer's chat
  template when it has one (every assistant turn labelled: the tokens the template adds for
  that turn), else with a plain `role: content` line per turn (logged).

`data.packing: true` concatenates examples and cuts full blocks (no padding, examples may
span blocks: the standard trade); `false` gives one example per block, truncated or padded
with EOS (label -100). Padding is on the right, so causal attention never lets a labelled
token see it. The split of an example is a seeded hash of its record, as for documents.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

from harness.config import DataConfig
from harness.data.documents import SPLITS, split_of
from harness.data.tokenizer import eos_id, given_tokenizer, train_bpe_tokenizer
from harness.errors import ConfigError
from harness.log import get_logger

log = get_logger(__name__)
IGNORE = -100
PAIRS = "pairs"  # the cache layout name in meta.json


def record_kind(record: Any) -> str | None:
    """ "prompt" or "messages" for a usable record, else None."""
    if isinstance(record, dict):
        if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
            return "prompt"
        if isinstance(record.get("messages"), list) and record["messages"]:
            return "messages"
    return None


def check_record(record: Any, where: str) -> None:
    """One line naming what an instruction record must hold (used by the pre-flight check too)."""
    if record_kind(record) is None:
        fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            f"{where}: data.format=instruction needs records with 'prompt' and 'response' strings or a "
            f"'messages' list of {{role, content}} (got: {fields})"
        )


def read_records(source: str) -> list[dict[str, Any]]:
    """Every record of a JSON lines file (or a directory of them, or JSON arrays), in file order."""
    if not os.path.exists(source):
        raise ConfigError(f"data.source '{source}' does not exist; data.format=instruction reads a local JSON lines file")
    files = sorted(glob.glob(os.path.join(source, "**", "*.json*"), recursive=True)) if os.path.isdir(source) else [source]
    records: list[dict[str, Any]] = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".json"):
                loaded = json.load(f)
                rows = loaded if isinstance(loaded, list) else [loaded]
            else:
                rows = []
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise ConfigError(f"data.source file '{path}' line {n} is not JSON ({e.msg})") from None
        for i, row in enumerate(rows):
            check_record(row, f"{path} record {i + 1}")
            records.append(row)
    if not records:
        raise ConfigError(f"data.source '{source}' holds no instruction records")
    return records


def _texts(record: dict[str, Any]) -> list[str]:
    if record_kind(record) == "prompt":
        return [record["prompt"], record["response"]]
    return [str(m.get("content", "")) for m in record["messages"]]


def _plain_turn(message: dict[str, Any]) -> str:
    return f"{message.get('role', 'user')}: {message.get('content', '')}\n"


def encode_record(record: dict[str, Any], tok: Any, eos: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one example: labels are -100 except on the response tokens."""
    if record_kind(record) == "prompt":
        prompt = tok(record["prompt"], add_special_tokens=False)["input_ids"]
        response = tok(record["response"], add_special_tokens=False)["input_ids"] + [eos]
        return prompt + response, [IGNORE] * len(prompt) + response
    messages = record["messages"]
    if getattr(tok, "chat_template", None):
        ids: list[int] = []
        labels: list[int] = []
        for i, message in enumerate(messages):
            # The template renders a prefix of the conversation the same way whatever follows: the
            # tokens added by turn i are the difference between the renderings up to i and i + 1.
            upto = tok.apply_chat_template(messages[: i + 1], tokenize=True, add_generation_prompt=False)
            upto = list(upto["input_ids"] if isinstance(upto, dict) or hasattr(upto, "keys") else upto)
            if upto[: len(ids)] != ids:
                raise ConfigError(
                    "the tokenizer's chat template renders a conversation prefix differently once more turns "
                    "follow; give prompt/response records instead"
                )
            added = upto[len(ids) :]
            ids += added
            labels += added if message.get("role") == "assistant" else [IGNORE] * len(added)
        return ids, labels
    ids, labels = [], []
    for message in messages:
        piece = tok(_plain_turn(message), add_special_tokens=False)["input_ids"]
        if message.get("role") == "assistant":
            piece = piece + [eos]
        ids += piece
        labels += piece if message.get("role") == "assistant" else [IGNORE] * len(piece)
    return ids, labels


def to_blocks(examples: list[tuple[list[int], list[int]]], seq_len: int, packing: bool, eos: int) -> tuple[np.ndarray, int]:
    """`(n, 2, seq_len)` int32 blocks, and how many examples lost labelled tokens to truncation."""
    if packing:
        ids = np.fromiter((t for e in examples for t in e[0]), dtype=np.int64)
        labels = np.fromiter((t for e in examples for t in e[1]), dtype=np.int64)
        n = len(ids) // seq_len
        pairs = np.stack([ids[: n * seq_len].reshape(n, seq_len), labels[: n * seq_len].reshape(n, seq_len)], axis=1)
        return pairs.astype(np.int32), 0
    pairs = np.empty((len(examples), 2, seq_len), dtype=np.int32)
    pairs[:, 0], pairs[:, 1] = eos, IGNORE
    truncated = 0
    for i, (ids_e, labels_e) in enumerate(examples):
        k = min(len(ids_e), seq_len)
        pairs[i, 0, :k], pairs[i, 1, :k] = ids_e[:k], labels_e[:k]
        truncated += int(any(lab != IGNORE for lab in labels_e[seq_len:]))
    return pairs, truncated


def prepare_instructions(model_name: str, cfg: DataConfig, out: str) -> dict[str, Any]:
    """Write `<out>/<split>.pairs.npy` for every split; returns the cache statistics (with the tokenizer)."""
    records = read_records(cfg.source)
    splits = [split_of(json.dumps(r, sort_keys=True), cfg) for r in records]
    tok = given_tokenizer(model_name, cfg)
    if tok is None:
        train_texts = [t for r, s in zip(records, splits) if s == "train" for t in _texts(r)]
        tok = train_bpe_tokenizer([train_texts], cfg.vocab_size, os.path.join(out, "tokenizer"))
    if any(record_kind(r) == "messages" for r in records) and not getattr(tok, "chat_template", None):
        log.info("data: the tokenizer has no chat template; messages are rendered as 'role: content' lines")
    eos = eos_id(tok, cfg)
    stats: dict[str, Any] = {
        "tokens": {},
        "documents": {},
        "labelled": {},
        "bytes": 0,
        "dtype": "int32",
        "max_id": eos,
        "tokenizer": tok,
        "layout": PAIRS,
    }
    for split in SPLITS:
        examples = [encode_record(r, tok, eos) for r, s in zip(records, splits) if s == split]
        pairs, truncated = to_blocks(examples, cfg.seq_len, cfg.packing, eos)
        if truncated:
            log.warning(f"data: {truncated} {split} examples are longer than data.seq_len={cfg.seq_len}; their response is cut")
        np.save(os.path.join(out, f"{split}.{PAIRS}.npy"), pairs)
        stats["tokens"][split] = int(pairs.shape[0] * cfg.seq_len)
        stats["documents"][split] = len(examples)
        stats["labelled"][split] = int((pairs[:, 1] != IGNORE).sum())
        stats["max_id"] = max(stats["max_id"], int(pairs[:, 0].max()) if pairs.size else 0)
        stats["bytes"] += sum(len(t.encode("utf-8")) for r, s in zip(records, splits) if s == split for t in _texts(r))
    return stats


def load_pairs(cache: str) -> dict[str, np.ndarray]:
    """The memory-mapped `(n, 2, seq_len)` blocks of every split."""
    return {split: np.load(os.path.join(cache, f"{split}.{PAIRS}.npy"), mmap_mode="r") for split in SPLITS}


__all__ = [
    "IGNORE",
    "PAIRS",
    "check_record",
    "encode_record",
    "load_pairs",
    "prepare_instructions",
    "read_records",
    "record_kind",
    "to_blocks",
]
