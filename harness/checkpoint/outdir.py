"""Where an export may be written, and what it may replace: only an earlier export of harness's own.

An export directory (`harness.export --out`, a run's `<output_dir>/hf` and `adapter/`) is
written into a fresh temporary directory beside it and renamed into place; it carries a
marker, `.harness-export`, listing the files harness wrote. A target that already exists is
replaced only when it is such an export (every entry listed in its marker) and the caller
allowed it (`--overwrite`; a run that continues or overwrites its own output directory);
anything else in it - a user's files, a run directory, the checkpoint being exported - is
never deleted: the export is refused with one line naming what is there.
"""

from __future__ import annotations

import json
import os
import tempfile

from harness.checkpoint.layout import remove_tree
from harness.errors import ConfigError

EXPORT_MARK = ".harness-export"


def _inside(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def is_harness_export(out: str) -> bool:
    """True when every entry of `out` is one its `.harness-export` marker lists."""
    try:
        with open(os.path.join(out, EXPORT_MARK), encoding="utf-8") as f:
            listed = set(json.load(f)["files"])
        present = set(os.listdir(out)) - {EXPORT_MARK}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return present <= listed


def export_target_refusal(out: str, checkpoint: str | None, overwrite: bool, flag: str = "--overwrite") -> str:
    """Why `out` cannot receive an export of `checkpoint` ("" when it can). `flag`: what the
    user sets to allow replacing an earlier export."""
    if checkpoint is not None and (_inside(checkpoint, out) or _inside(out, checkpoint)):
        return f"'{out}' contains or lies inside the checkpoint being exported ({checkpoint}); choose a directory outside it"
    if not os.path.lexists(out):
        return ""
    if not os.path.isdir(out) or os.path.islink(out):
        return f"'{out}' exists and is not a directory; choose a new directory"
    entries = sorted(os.listdir(out))
    if not entries:
        return ""
    if not is_harness_export(out):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        return (
            f"'{out}' is not empty and is not an export written by harness ({len(entries)} entries: {shown}); nothing in it is "
            "deleted: choose a new or empty directory"
        )
    if not overwrite:
        return f"'{out}' holds an earlier harness export; set {flag} to replace it, or choose a new directory"
    return ""


def check_export_target(out: str, checkpoint: str | None, overwrite: bool, flag: str = "--overwrite") -> None:
    """ConfigError (one line) when `export_target_refusal` refuses."""
    why = export_target_refusal(out, checkpoint, overwrite, flag)
    if why:
        raise ConfigError(why)


def new_export_dir(out: str) -> str:
    """A fresh temporary directory beside `out` (same file system, so the final rename is atomic);
    no name a user could own is ever reused or removed."""
    parent = os.path.dirname(os.path.abspath(out.rstrip(os.sep))) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(out.rstrip(os.sep))}.harness-tmp-", dir=parent)


def commit_export(tmp: str, out: str, checkpoint: str, overwrite: bool, flag: str = "--overwrite") -> list[str]:
    """Mark `tmp` as harness's export and rename it to `out`, replacing an earlier harness export
    only (checked again now: the directory may have changed since pre-flight). Returns the
    names of what was replaced (for the caller's log line)."""
    why = export_target_refusal(out, checkpoint, overwrite, flag)
    if why:
        remove_tree(tmp)
        raise ConfigError(why)
    files = sorted(os.listdir(tmp))
    with open(os.path.join(tmp, EXPORT_MARK), "w", encoding="utf-8") as f:
        json.dump({"checkpoint": os.path.abspath(checkpoint), "files": files}, f, indent=1)
    replaced = sorted(set(os.listdir(out)) - {EXPORT_MARK}) if os.path.isdir(out) else []
    if os.path.isdir(out):
        remove_tree(out)
    os.rename(tmp, out)
    return replaced
