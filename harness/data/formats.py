"""Instruction record layouts other tools ship, turned into the `messages` harness trains on.

- Alpaca (`{"instruction", "input", "output"}`, optional `system` and `history` - LLaMA-Factory's
  `alpaca` formatting, axolotl's `alpaca` type): the user turn is the instruction, then a blank line
  and the input when the input is not empty; the assistant turn is the output; `history` (pairs of
  user and assistant strings) comes before, `system` first.
- ShareGPT (`{"conversations": [{"from", "value"}, ...]}`, optional `system` - LLaMA-Factory's
  `sharegpt`, axolotl's `chat_template` type): `from` one of `ROLES`.
- Chat `messages` (`[{"role", "content"}, ...]`, OpenAI's and TRL's layout): each `role` one of
  `ROLES` (ShareGPT's and Gemma's names - human, gpt, model, bot - as the role harness labels
  by), each `content` a string or OpenAI-style content parts (`[{"type": "text", "text": ...}]`:
  the text parts concatenated; an image or other part is refused).

A converted record is an ordinary `messages` record, so it is split, tokenized and labelled exactly
as the `messages` file of the same conversations would be. A record the conversion cannot read is
one line naming its file, record and field.
"""

from __future__ import annotations

from typing import Any

from harness.errors import ConfigError

# The role names chat files use (TRL's and OpenAI's, ShareGPT's, Gemma's `model`, LLaMA-Factory's and
# axolotl's role maps), as the three roles harness renders and labels by: only `assistant` is labelled.
ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
}
ALPACA_FIELDS = ("instruction", "output")  # what marks a record as Alpaca (`input` may be absent)


def layout_of(record: Any) -> str | None:
    """The layout a record is written in ("prompt", "messages", "alpaca", "sharegpt"), from its fields."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "prompt" in record or "response" in record:
        return "prompt"
    if "conversations" in record:
        return "sharegpt"
    if any(f in record for f in ALPACA_FIELDS):
        return "alpaca"
    return None


def format_hint(columns: list[str]) -> str:
    """What to set when a text source's columns are an instruction layout (empty otherwise)."""
    layout = layout_of(dict.fromkeys(columns))
    return f"; its columns are {layout} records: set data.format=instruction" if layout else ""


def _string(record: dict[str, Any], key: str, where: str, layout: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in record else f"of type {type(value).__name__}"
        raise ConfigError(f"{where}: field '{key}' is {got}; {layout} needs it as a string (fields: {', '.join(record)})")
    return value


def _system(record: dict[str, Any], where: str, layout: str) -> list[dict[str, str]]:
    """The record's `system` prompt as the first turn (none when absent or empty)."""
    if record.get("system") in (None, ""):
        return []
    return [{"role": "system", "content": _string(record, "system", where, layout)}]


def alpaca_messages(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    instruction = _string(record, "instruction", where, "an Alpaca record")
    output = _string(record, "output", where, "an Alpaca record")
    extra = record.get("input") or ""
    if not isinstance(extra, str):
        raise ConfigError(f"{where}: an Alpaca record's 'input' must be a string (got a {type(extra).__name__})")
    messages = _system(record, where, "an Alpaca record")
    for n, pair in enumerate(record.get("history") or []):
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise ConfigError(f"{where}: 'history' item {n + 1} must be a [user, assistant] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def sharegpt_messages(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: a ShareGPT record needs 'conversations' as a non-empty list of {{from, value}}")
    messages = _system(record, where, "a ShareGPT record")
    for n, turn in enumerate(turns):
        at = f"{where}, conversations[{n}]"
        if not isinstance(turn, dict):
            raise ConfigError(f"{at}: a turn must be an object with 'from' and 'value' (got a {type(turn).__name__})")
        role = _role(turn.get("from"), at, "from")
        messages.append({"role": role, "content": _string(turn, "value", at, "a ShareGPT turn")})
    return messages


def _role(name: Any, at: str, key: str) -> str:
    """The role harness renders and labels by, from a file's role name (one of `ROLES`)."""
    if not isinstance(name, str) or name.lower() not in ROLES:
        raise ConfigError(
            f"{at}: '{key}' is {name!r}, a role harness does not train on; "
            f"use one of {', '.join(ROLES)} (tool and function turns are not read)"
        )
    return ROLES[name.lower()]


def _content(value: Any, at: str) -> str:
    """A turn's text: a string, or OpenAI-style content parts with their text parts concatenated."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for n, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ConfigError(
                    f"{at}, content[{n}]: a {kind!r} part; harness trains on text only: give each part as "
                    '{"type": "text", "text": "..."}, or the content as a string'
                )
            texts.append(part["text"])
        return "".join(texts)
    got = "missing" if value is None else f"of type {type(value).__name__}"
    raise ConfigError(f"{at}: 'content' is {got}; give it as a string or a list of text parts")


def chat_messages(record: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A `messages` record's turns with their roles as `ROLES` names them and their content as text
    (a turn already so is unchanged, so its record hashes, splits and renders as before)."""
    messages = []
    for n, turn in enumerate(record["messages"]):
        at = f"{where}, messages[{n}]"
        if not isinstance(turn, dict):
            raise ConfigError(f"{at}: a turn must be an object with 'role' and 'content' (got a {type(turn).__name__})")
        messages.append({**turn, "role": _role(turn.get("role"), at, "role"), "content": _content(turn.get("content"), at)})
    return messages


def as_messages(record: Any, where: str, layout: str) -> Any:
    """An Alpaca or ShareGPT record as a `messages` record, a `messages` record's roles and content as
    harness reads them (`chat_messages`); any other record as it is."""
    if layout == "messages" and isinstance(record.get("messages"), list):
        return {**record, "messages": chat_messages(record, where)}
    if layout == "alpaca":
        return {"messages": alpaca_messages(record, where)}
    if layout == "sharegpt":
        return {"messages": sharegpt_messages(record, where)}
    return record


__all__ = ["ROLES", "alpaca_messages", "as_messages", "chat_messages", "format_hint", "layout_of", "sharegpt_messages"]
