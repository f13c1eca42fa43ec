"""Instruction record layouts other tools ship, turned into the `messages` harness trains on.

- Alpaca (`{"instruction", "input", "output"}`, optional `system` and `history` - LLaMA-Factory's
  `alpaca` formatting, axolotl's `alpaca` type): the user turn is the instruction, then a blank line
  and the input when the input is not empty; the assistant turn is the output; `history` (pairs of
  user and assistant strings) comes before, `system` first.
- ShareGPT (`{"conversations": [{"from", "value"}, ...]}`, optional `system` - LLaMA-Factory's
  `sharegpt`, axolotl's `chat_template` type): `from` human/user, gpt/assistant, system.

A converted record is an ordinary `messages` record, so it is split, tokenized and labelled exactly
as the `messages` file of the same conversations would be. A record the conversion cannot read is
one line naming its file, record and field.
"""

from __future__ import annotations

from typing import Any

from harness.errors import ConfigError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
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
        role = turn.get("from")
        if role not in SHAREGPT_ROLES:
            raise ConfigError(
                f"{at}: 'from' is {role!r}, a role harness does not train on; "
                f"use one of {', '.join(SHAREGPT_ROLES)} (tool and function turns are not read)"
            )
        messages.append({"role": SHAREGPT_ROLES[role], "content": _string(turn, "value", at, "a ShareGPT turn")})
    return messages


def as_messages(record: Any, where: str, layout: str) -> Any:
    """An Alpaca or ShareGPT record as a `messages` record; any other record as it is."""
    if layout == "alpaca":
        return {"messages": alpaca_messages(record, where)}
    if layout == "sharegpt":
        return {"messages": sharegpt_messages(record, where)}
    return record


__all__ = ["SHAREGPT_ROLES", "alpaca_messages", "as_messages", "format_hint", "layout_of", "sharegpt_messages"]
