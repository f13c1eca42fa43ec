"""The configuration reference (docs/configuration.md), generated from the schema.

Every key's type, default and meaning come from its field in `harness.config.schema`: the
type from the annotation (a `Literal`'s choices spelled out), the default from the dataclass,
the meaning from the comments beside and directly above the field, and each section's
introduction from its class docstring. The document is written by
`python -m harness.config --reference > docs/configuration.md` and compared with the schema by
tests/unit/test_config_reference.py, so a key added, renamed or re-described in the schema
without the document (or the other way round) fails the suite.
"""

from __future__ import annotations

import ast
import inspect
import io
import tokenize
from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Any, get_type_hints

from harness.config import schema
from harness.config.schema import RunConfig
from harness.config.vocabulary import literal_choices

HEADER = "# Configuration reference\n\nBack to the [README](../README.md).\n"
GENERATED = (
    "<!-- Generated from harness/config/schema.py by `python -m harness.config --reference`; "
    "tests/unit/test_config_reference.py fails when the two differ. Edit the schema's comments, not this file. -->"
)


def _source_facts() -> tuple[dict[tuple[str, str], str], dict[tuple[str, str], str]]:
    """(class, field) -> the comments documenting it, and -> its annotation as written."""
    source = inspect.getsource(schema)
    lines = source.splitlines()
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    docs: dict[tuple[str, str], str] = {}
    annotations: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above, row = [], stmt.lineno - 1
            while row in comments and lines[row - 1].lstrip().startswith("#"):
                above.insert(0, comments[row])
                row -= 1
            end = stmt.end_lineno or stmt.lineno
            beside = [comments[end]] if end in comments and not lines[end - 1].lstrip().startswith("#") else []
            docs[(node.name, stmt.target.id)] = " ".join(above + beside)
            annotations[(node.name, stmt.target.id)] = ast.unparse(stmt.annotation)
    return docs, annotations


def _cell(text: str) -> str:
    """Table-safe: a pipe ends a cell, and `<name>` would be read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _default(f: Field) -> str:
    value: Any = f.default if f.default is not MISSING else f.default_factory() if f.default_factory is not MISSING else None
    if value is None:
        return "–"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`"


def _type(cls: type, f: Field, annotations: dict[tuple[str, str], str]) -> str:
    choices = literal_choices(get_type_hints(cls)[f.name])
    if choices is None:
        return _cell(f"`{annotations[(cls.__name__, f.name)]}`")
    values, optional = choices
    return " \\| ".join(f"`{v}`" for v in values) + (" \\| unset" if optional else "")


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every leaf key of a config dataclass, in the schema's order."""
    docs, annotations = _source_facts()
    out = []
    for f in fields(cls):
        if is_dataclass(get_type_hints(cls)[f.name]):
            continue
        out.append((f"`{prefix}{f.name}`", _type(cls, f, annotations), _default(f), _cell(docs.get((cls.__name__, f.name), ""))))
    return out


def _table(cls: type, prefix: str) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    return lines + [f"| {' | '.join(row)} |" for row in rows(cls, prefix)]


def _intro(cls: type) -> list[str]:
    doc = inspect.cleandoc(cls.__doc__ or "")
    generated = doc.startswith(cls.__name__ + "(")  # dataclass's stand-in for a missing docstring
    return [] if generated or not doc else [" ".join(doc.split()), ""]


def reference_markdown() -> str:
    """docs/configuration.md, as the schema says it."""
    out = [HEADER, GENERATED, "", *_intro(RunConfig), "## The run", "", *_table(RunConfig, ""), ""]
    hints = get_type_hints(RunConfig)
    for f in fields(RunConfig):
        section = hints[f.name]
        if is_dataclass(section):
            out += [f"## `{f.name}`", "", *_intro(section), *_table(section, f.name + "."), ""]
    return "\n".join(out)


def undocumented() -> list[str]:
    """Keys whose field has no comment in the schema."""
    hints = get_type_hints(RunConfig)
    sections = [(RunConfig, "")] + [(hints[f.name], f.name + ".") for f in fields(RunConfig) if is_dataclass(hints[f.name])]
    return [key.strip("`") for cls, prefix in sections for key, _, _, meaning in rows(cls, prefix) if not meaning]


__all__ = ["reference_markdown", "rows", "undocumented"]
