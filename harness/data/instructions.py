"""Instruction data (`data.format: instruction`): JSON lines of prompt/response pairs or chat
`messages`, tokenized into blocks that carry their own labels and positions, loss on the
response only.

Each block is three rows, `(input_ids, labels, position_ids)`, stored as one `(n, 3, seq_len)`
int32 array per split (`<split>.examples.npy`, memory-mapped). Labels are the token ids where
the model must learn to answer and -100 on prompt tokens and padding, so the ordinary causal-LM
loss (`harness.training.labelled_lm_loss`) counts response tokens only. Positions restart at 0
with every example: given position ids and no attention mask, transformers confines attention
to each example (its packed-sequence masks for sdpa/eager/flex; flash-attention's varlen path on
a GPU), so packed examples never see each other. The samplers, checkpoints and resume treat
these blocks like any other (a block is a row of the array).

- `{"prompt": ..., "response": ...}`: the tokenizer's leading specials (a BOS, where it adds
  one), prompt tokens, then response tokens and EOS (labelled).
- `{"messages": [{"role": ..., "content": ...}, ...]}`: rendered with the tokenizer's chat
  template when it has one. Labelled: what TRL's assistant-only loss labels - the template's
  `{% generation %}` mask where it has one, else each assistant turn after the rendering with
  `add_generation_prompt=True` (the assistant header; ChatML's `\n` after `assistant` is labelled,
  as in TRL's ChatML training templates) through its end-of-turn token and the whitespace after it.
  Without a template, a plain `role: content` line per turn (logged), labelled from the content
  of each assistant turn through its EOS, never its `assistant:` header.

`data.packing: true` packs whole examples into blocks, best-fit decreasing (TRL's BFD, axolotl's
multipack): no example is cut at a block boundary and none is dropped; `false` gives one example
per block. Either way an example longer than `seq_len` is truncated (counted, warned) and the
rest of a block is padding (EOS, label -100), whose positions continue the last example's: tail
padding attends only to what precedes it and nothing attends to it (causal), so it changes no
labelled token, and a row of one example has positions 0..S-1 with no restart, so transformers
builds no mask for it (a restart there would make it build the packed-sequence (B, 1, S, S) mask
and give up grouped-query sdpa, memory the planner does not book for unpacked rows). The split
of an example is a seeded hash of its record, as for documents.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import re
from typing import Any

import numpy as np

from harness.config import DataConfig
from harness.data.documents import SPLITS, split_of
from harness.data.folders import folder_layout
from harness.data.formats import ROLES, as_messages, layout_of
from harness.data.tokenizer import eos_id, given_tokenizer, leading_specials, train_bpe_tokenizer
from harness.errors import ConfigError
from harness.log import get_logger

log = get_logger(__name__)
IGNORE = -100
EXAMPLES = "examples"  # the cache layout name in meta.json: (n, 3, seq_len) input_ids, labels, position_ids
# What an instruction cache holds, in its key: a cache written by other rules is never read as this one.
LAYOUT_VERSION = (
    "examples-4: whole-example BFD packing, positions per example (padding continues the last), TRL's assistant spans, "
    "no plain-chat header, leading specials, chat roles by harness.data.formats.ROLES, text content parts"
)


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
            f"{where}: data.format=instruction needs records with 'prompt' and 'response' strings, a "
            f"'messages' list of {{role, content}}, Alpaca's instruction/input/output or ShareGPT's conversations (got: {fields})"
        )


def read_records(source: str, fmt: str = "instruction") -> list[dict[str, Any]]:
    """Every record of a JSON lines file (or a directory of them, or JSON arrays), in file order;
    Alpaca and ShareGPT records as `messages` (`fmt` names the layout, or "instruction": each record's fields)."""
    if not os.path.exists(source):
        raise ConfigError(f"data.source '{source}' does not exist; data.format=instruction reads a local JSON lines file")
    if folder_layout(source):
        raise ConfigError(
            f"data.source '{source}' is a datasets folder; instruction records are read from JSON lines: "
            "write them with Dataset.to_json('records.jsonl') and point data.source at that file"
        )
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
            where = f"{path} record {i + 1}"
            record = as_messages(row, where, fmt if fmt in ("alpaca", "sharegpt") else layout_of(row) or "")
            check_record(record, where)
            records.append(record)
    if not records:
        raise ConfigError(f"data.source '{source}' holds no instruction records")
    return records


def _texts(record: dict[str, Any]) -> list[str]:
    if record_kind(record) == "prompt":
        return [record["prompt"], record["response"]]
    return [str(m.get("content", "")) for m in record["messages"]]


def _plain_turn(message: dict[str, Any]) -> tuple[str, str]:
    """A turn without a chat template: its header (`role:`) and its body (` content` and a newline)."""
    return f"{message.get('role', 'user')}:", f" {message.get('content', '')}\n"


def _ids(rendered: Any) -> list[int]:
    return list(rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered)


GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


# The generation prompt after which TRL's training templates (qwen2.5, qwen3: ChatML) label the
# separator too: `\n` + answer + `<|im_end|>` + `\n`. Elsewhere (Llama 3, Gemma, Phi-3) they label
# from the answer on; everywhere through the whitespace after the end-of-turn token.
TRL_LABELLED_SEPARATOR = {"<|im_start|>assistant\n": "\n"}


def _assistant_header(messages: list[dict[str, Any]], i: int, ids: list[int], upto: list[int], tok: Any) -> list[int]:
    """The tokens before assistant turn i's labels: the rendering with the generation prompt
    (TRL's header), less the separator TRL labels; `ids` when the template renders no prompt."""
    if not i:
        return ids
    header = _ids(tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True))
    if upto[: len(header)] != header:
        return ids  # the template does not render a generation prompt as its turn begins
    prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
    for opening, labelled in TRL_LABELLED_SEPARATOR.items():
        sep = tok(labelled, add_special_tokens=False)["input_ids"]
        if prompt.endswith(opening) and header[-len(sep) :] == sep:
            return header[: -len(sep)]
    return header


def _template_labels(messages: list[dict[str, Any]], tok: Any) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation through the tokenizer's chat template: the template's
    `{% generation %}` mask where it has one, else what TRL's training templates label - each
    assistant turn after its header, through its end-of-turn token and the whitespace after it."""
    if GENERATION_TAG.search(tok.chat_template or ""):  # the template marks what the assistant generates
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        return ids, [t if m else IGNORE for t, m in zip(ids, out["assistant_masks"])]
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        # The template renders a prefix of the conversation the same way whatever follows: the
        # tokens added by turn i are the difference between the renderings up to i and i + 1.
        upto = _ids(tok.apply_chat_template(messages[: i + 1], tokenize=True, add_generation_prompt=False))
        header = _assistant_header(messages, i, ids, upto, tok) if message.get("role") == "assistant" else ids
        if upto[: len(ids)] != ids or header[: len(ids)] != ids:
            raise ConfigError(
                "the tokenizer's chat template renders a conversation prefix differently once more turns "
                "follow; give prompt/response records instead"
            )
        labels += [IGNORE] * (len(header) - len(ids))
        added = upto[len(header) :]
        labels += added if message.get("role") == "assistant" else [IGNORE] * len(added)
        ids = upto
    return ids, labels


def encode_record(record: dict[str, Any], tok: Any, eos: int, prefix: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one example: labels are -100 except on the response tokens.
    `prefix`: the tokenizer's leading specials (`leading_specials`), put before a prompt or plain chat."""
    prefix = list(prefix or [])
    if record_kind(record) == "prompt":
        prompt = prefix + tok(record["prompt"], add_special_tokens=False)["input_ids"]
        response = tok(record["response"], add_special_tokens=False)["input_ids"] + [eos]
        return prompt + response, [IGNORE] * len(prompt) + response
    messages = record["messages"]
    if getattr(tok, "chat_template", None):
        return _template_labels(messages, tok)  # the template writes its own specials
    ids, labels = prefix, [IGNORE] * len(prefix)
    for message in messages:  # `role: content` lines; an assistant's header is never a target
        header, body = (tok(text, add_special_tokens=False)["input_ids"] for text in _plain_turn(message))
        if message.get("role") == "assistant":
            body = body + [eos]
        ids += header + body
        labels += [IGNORE] * len(header) + (body if message.get("role") == "assistant" else [IGNORE] * len(body))
    return ids, labels


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Example indices grouped into bins of at most `capacity` tokens: longest first, each into
    the fullest bin it still fits (TRL's BFD, axolotl's multipack), so few bins and no example split."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, bin), sorted: the first that fits is the fullest
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= lengths[i]
        if room > 0:
            bisect.insort(free, (room, b))
    return bins


def to_blocks(examples: list[tuple[list[int], list[int]]], seq_len: int, packing: bool, eos: int) -> tuple[np.ndarray, int]:
    """`(n, 3, seq_len)` int32 blocks (input_ids, labels, position_ids) of whole examples, and how
    many examples lost labelled tokens to truncation at `seq_len`."""
    truncated = sum(any(lab != IGNORE for lab in labels[seq_len:]) for _, labels in examples)
    # An example's first token is never a target: in a packed block it would be predicted from the previous example.
    cut = [(ids[:seq_len], [IGNORE, *labels[1:seq_len]]) for ids, labels in examples if ids]
    groups = best_fit_decreasing([len(ids) for ids, _ in cut], seq_len) if packing else [[i] for i in range(len(cut))]
    blocks = np.empty((len(groups), 3, seq_len), dtype=np.int32)
    for b, group in enumerate(groups):
        ids = [t for i in group for t in cut[i][0]]
        labels = [t for i in group for t in cut[i][1]]
        positions = [p for i in group for p in range(len(cut[i][0]))]
        pad = seq_len - len(ids)  # the rest: EOS, no label, the last example's positions continued (module docstring)
        last = len(cut[group[-1]][0])
        blocks[b, 0] = ids + [eos] * pad
        blocks[b, 1] = labels + [IGNORE] * pad
        blocks[b, 2] = positions + list(range(last, last + pad))
    return blocks, truncated


def prepare_instructions(model_name: str, cfg: DataConfig, out: str) -> dict[str, Any]:
    """Write `<out>/<split>.examples.npy` for every split; returns the cache statistics (with the tokenizer)."""
    records = read_records(cfg.source, cfg.format)
    splits = [split_of(json.dumps(r, sort_keys=True), cfg) for r in records]
    tok = given_tokenizer(model_name, cfg)
    if tok is None:
        train_texts = [t for r, s in zip(records, splits) if s == "train" for t in _texts(r)]
        tok = train_bpe_tokenizer([train_texts], cfg.vocab_size, os.path.join(out, "tokenizer"))
    if any(record_kind(r) == "messages" for r in records) and not getattr(tok, "chat_template", None):
        log.info("data: the tokenizer has no chat template; messages are rendered as 'role: content' lines")
    eos = eos_id(tok, cfg)
    prefix = leading_specials(tok)
    stats: dict[str, Any] = {
        "tokens": {},
        "documents": {},
        "labelled": {},
        "bytes": 0,
        "dtype": "int32",
        "max_id": eos,
        "tokenizer": tok,
        "layout": EXAMPLES,
    }
    for split in SPLITS:
        examples = [encode_record(r, tok, eos, prefix) for r, s in zip(records, splits) if s == split]
        blocks, truncated = to_blocks(examples, cfg.seq_len, cfg.packing, eos)
        if truncated:
            log.warning(f"data: {truncated} {split} examples are longer than data.seq_len={cfg.seq_len}; their response is cut")
        np.save(os.path.join(out, f"{split}.{EXAMPLES}.npy"), blocks)
        stats["tokens"][split] = int(blocks.shape[0] * cfg.seq_len)
        stats["documents"][split] = len(examples)
        stats["labelled"][split] = int((blocks[:, 1] != IGNORE).sum())
        stats["max_id"] = max(stats["max_id"], int(blocks[:, 0].max()) if blocks.size else 0)
        stats["bytes"] += sum(len(t.encode("utf-8")) for r, s in zip(records, splits) if s == split for t in _texts(r))
        check_labelled(stats, split, cfg, truncated)
    return stats


def check_labelled(stats: dict[str, Any], split: str, cfg: DataConfig, truncated: int) -> None:
    """A split of examples none of whose tokens is labelled trains (or measures) nothing: one line."""
    n = stats["documents"][split]
    if n and not stats["labelled"][split]:
        cut = f", or raise data.seq_len={cfg.seq_len} ({truncated} of them are cut there)" if truncated else ""
        raise ConfigError(
            f"data.source '{cfg.source}': the {split} split's {n} examples have no labelled token; every example needs a "
            f"response or an assistant turn (role {', '.join(r for r, as_ in ROLES.items() if as_ == 'assistant')}) with text{cut}"
        )


def load_examples(cache: str) -> dict[str, np.ndarray]:
    """The memory-mapped `(n, 3, seq_len)` blocks of every split."""
    return {split: np.load(os.path.join(cache, f"{split}.{EXAMPLES}.npy"), mmap_mode="r") for split in SPLITS}


__all__ = [
    "EXAMPLES",
    "IGNORE",
    "LAYOUT_VERSION",
    "best_fit_decreasing",
    "check_labelled",
    "check_record",
    "encode_record",
    "load_examples",
    "prepare_instructions",
    "read_records",
    "record_kind",
    "to_blocks",
]
