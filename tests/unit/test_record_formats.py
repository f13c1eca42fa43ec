"""Alpaca and ShareGPT files: the same blocks (tokens, labels, positions, splits) as the `messages`
file of the same conversations; a record they cannot be read from is one line naming its file,
record and field, and nothing is left in the cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.config import DataConfig
from harness.data import prepare_data
from harness.data.instructions import load_examples, prepare_instructions, read_records
from harness.data.tokenizer import train_bpe_tokenizer
from harness.errors import ConfigError

# A shipped-style ChatML template (no generation marks), as SmolLM2-Instruct's and Qwen's are.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = "pear apple fig date plum kiwi lime sort the words reverse count letters in".split()


def conversation(k: int) -> dict:
    """Conversation k: a system line on some, an earlier exchange on some, an input on some."""
    words = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(3 + k % 4))
    system = "You sort words." if k % 3 == 0 else ""
    history = [[f"Count: {words}", str(len(words.split()))]] if k % 4 == 1 else []
    extra = words if k % 2 else ""
    return {
        "system": system,
        "history": history,
        "instruction": f"Sort these {k}",
        "input": extra,
        "output": " ".join(sorted(words.split())),
    }


def as_messages(c: dict) -> list[dict]:
    turns = [{"role": "system", "content": c["system"]}] if c["system"] else []
    for user, answer in c["history"]:
        turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    user = c["instruction"] + ("\n\n" + c["input"] if c["input"] else "")
    return [*turns, {"role": "user", "content": user}, {"role": "assistant", "content": c["output"]}]


def as_alpaca(c: dict) -> dict:
    out = {"instruction": c["instruction"], "input": c["input"], "output": c["output"]}
    return out | ({"system": c["system"]} if c["system"] else {}) | ({"history": c["history"]} if c["history"] else {})


def as_sharegpt(c: dict) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in as_messages(c)]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    tok = train_bpe_tokenizer([WORDS * 30 + ["system user assistant Sort these Count"] * 30], 300, str(root / "tok"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(root / "tok")
    convs = [conversation(k) for k in range(60)]
    return {
        "tokenizer": root / "tok",
        "messages": write_jsonl(root / "messages.jsonl", [{"messages": as_messages(c)} for c in convs]),
        "alpaca": write_jsonl(root / "alpaca.jsonl", [as_alpaca(c) for c in convs]),
        "sharegpt": write_jsonl(root / "sharegpt.jsonl", [as_sharegpt(c) for c in convs]),
    }


def _cfg(files, fmt: str, source: str, **kw) -> DataConfig:
    return DataConfig(source=str(files[source]), tokenizer=str(files["tokenizer"]), seq_len=96, format=fmt, eval_fraction=0.2, **kw)


@pytest.mark.parametrize("layout", ["alpaca", "sharegpt"])
@pytest.mark.parametrize("named", [False, True], ids=["detected", "named"])
def test_alpaca_and_sharegpt_give_the_blocks_of_the_same_messages(files, tmp_path, layout, named):
    blocks = {}
    for source, fmt in (("messages", "instruction"), (layout, layout if named else "instruction")):
        out = tmp_path / source
        out.mkdir()
        stats = prepare_instructions("tiny-llama", _cfg(files, fmt, source), str(out))
        blocks[source] = load_examples(str(out))
        assert all(stats["documents"][s] for s in ("train", "eval", "calib"))
    for split in ("train", "eval", "calib"):
        np.testing.assert_array_equal(blocks[layout][split], blocks["messages"][split])
    assert (blocks[layout]["train"][:, 1] != -100).sum() > 0


def test_an_alpaca_user_turn_is_instruction_blank_line_input(files):
    records = read_records(str(files["alpaca"]))
    assert records[1]["messages"][-2:] == [
        {"role": "user", "content": "Sort these 1\n\n" + conversation(1)["input"]},
        {"role": "assistant", "content": conversation(1)["output"]},
    ]
    assert records[0]["messages"][0] == {"role": "system", "content": "You sort words."}
    assert records[2]["messages"][-2]["content"] == "Sort these 2"  # an empty input is left out


BAD = [
    ("alpaca", [{"instruction": "a", "output": "b"}, {"instruction": "Sort", "input": "x"}], "record 2: field 'output' is missing"),
    ("instruction", [{"instruction": "Sort", "output": 3}], "record 1: field 'output' is of type int"),
    (
        "sharegpt",
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "observation", "value": "{}"}]}],
        "record 1, conversations[1]: 'from' is 'observation'",
    ),
    ("instruction", [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}], "conversations[1]: field 'value' is missing"),
    ("sharegpt", [{"messages": [{"role": "user", "content": "hi"}]}], "needs 'conversations'"),
    (
        "instruction",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]}],
        "record 1, messages[1]: 'role' is 'tool'",
    ),
    (
        "instruction",
        [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}]}],
        "record 1, messages[0], content[0]: a 'image_url' part",
    ),
    ("instruction", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}], "messages[1]: 'content' is missing"),
    (
        "instruction",
        [{"messages": [{"role": "system", "content": f"be brief {k}"}, {"role": "user", "content": f"hi {k}"}]} for k in range(20)],
        "the train split's",
    ),
]


@pytest.mark.parametrize(
    "fmt, rows, expected",
    BAD,
    ids=["no_output", "output_not_str", "unknown_role", "no_value", "not_sharegpt", "tool_role", "image_part", "no_content", "no_labels"],
)
def test_a_bad_record_is_one_line_naming_file_record_and_field_and_nothing_is_cached(files, tmp_path, fmt, rows, expected):
    source = write_jsonl(tmp_path / "bad.jsonl", rows)
    cache = tmp_path / "cache"
    cfg = DataConfig(source=str(source), tokenizer=str(files["tokenizer"]), format=fmt, cache_dir=str(cache))
    with pytest.raises(ConfigError) as err:
        prepare_data("tiny-llama", cfg, progress=False)
    message = str(err.value)
    assert "\n" not in message and str(source) in message and expected in message, message
    assert not [p for p in cache.iterdir() if p.is_dir()], "a failed preparation left a directory in the cache"


def test_instruction_records_in_a_datasets_folder_are_refused_in_one_line(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"instruction": ["Sort"], "output": ["a b"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ConfigError, match="is a datasets folder; instruction records are read from JSON lines"):
        read_records(str(tmp_path / "saved"))


def _messages_file(files, path: Path, turn) -> Path:
    """The fixture's `messages` file with each turn rewritten by `turn`."""
    rows = [json.loads(line) for line in files["messages"].read_text().splitlines()]
    return write_jsonl(path, [{"messages": [turn(m) for m in r["messages"]]} for r in rows])


def _blocks(files, source: Path, out: Path) -> dict:
    out.mkdir()
    cfg = DataConfig(source=str(source), tokenizer=str(files["tokenizer"]), seq_len=96, format="instruction", eval_fraction=0.2)
    prepare_instructions("tiny-llama", cfg, str(out))
    return load_examples(str(out))


@pytest.mark.parametrize("assistant, user", [("gpt", "human"), ("model", "user"), ("bot", "human")])
def test_chat_role_names_of_other_tools_are_the_assistant_and_user(files, tmp_path, assistant, user):
    names = {"assistant": assistant, "user": user, "system": "system"}
    renamed = _messages_file(files, tmp_path / "renamed.jsonl", lambda m: {**m, "role": names[m["role"]]})
    got, want = _blocks(files, renamed, tmp_path / "renamed"), _blocks(files, files["messages"], tmp_path / "plain")
    for split in ("train", "eval", "calib"):
        np.testing.assert_array_equal(got[split], want[split])
    assert (got["train"][:, 1] != -100).sum() > 0


def test_openai_content_parts_are_their_text_parts_concatenated(files, tmp_path):
    def parts(m: dict) -> dict:
        text = m["content"]
        return {**m, "content": [{"type": "text", "text": text[:3]}, {"type": "text", "text": text[3:]}]}

    got = _blocks(files, _messages_file(files, tmp_path / "parts.jsonl", parts), tmp_path / "parts")
    want = _blocks(files, files["messages"], tmp_path / "plain")
    for split in ("train", "eval", "calib"):
        np.testing.assert_array_equal(got[split], want[split])
