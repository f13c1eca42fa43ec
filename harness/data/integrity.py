"""What makes a data cache trustworthy: keyed by its source's content, its files the sizes written.

A cache is found by a key of the data config; for a local source the key also holds each
file's size, modification time and a hash of its first and last MiB, so a corpus edited in
place is read again rather than served from the old cache. A prepared cache lists every
file's size in its meta.json; a file truncated or lost since (a full disk, a copy cut short)
makes the cache incomplete, and it is prepared again instead of failing on every start.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

from harness.errors import ConfigError

FINGERPRINT_BYTES = 1 << 20  # hashed at each end of every source file


def source_fingerprint(source: str) -> list[tuple[str, int, int, str]]:
    """(path, size, mtime_ns, hash of its first and last MiB) of every file of a local source: the
    cache key follows the content, at the cost of reading 2 MiB per file, not the corpus."""
    files = sorted(glob.glob(os.path.join(source, "**", "*"), recursive=True)) if os.path.isdir(source) else [source]
    out = []
    for path in (f for f in files if os.path.isfile(f)):
        st = os.stat(path)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            if st.st_size > FINGERPRINT_BYTES:
                f.seek(max(FINGERPRINT_BYTES, st.st_size - FINGERPRINT_BYTES))
                digest.update(f.read(FINGERPRINT_BYTES))
        out.append((os.path.relpath(path, source) if os.path.isdir(source) else "", st.st_size, st.st_mtime_ns, digest.hexdigest()[:16]))
    return out


def cache_problem(cache: str) -> str:
    """Why a cache with meta.json cannot be used ("" when it can): a file its manifest lists is
    missing or has another size (truncated by a full disk, a copy cut short)."""
    try:
        with open(os.path.join(cache, "meta.json"), encoding="utf-8") as f:
            files = json.load(f).get("files", {})
    except (OSError, ValueError, AttributeError) as exc:
        return f"meta.json is unreadable ({type(exc).__name__})"
    for name, size in sorted(files.items()):
        path = os.path.join(cache, name)
        found = os.path.getsize(path) if os.path.isfile(path) else None
        if found != size:
            return f"{name} {'is missing' if found is None else f'has {found} bytes, written with {size}'}"
    return ""


def check_cache_root(cache: str, create: bool = True) -> None:
    """The directory the cache goes into can be created (`create`: is) and written; ConfigError
    (one line) when it is under a file or read-only. Pre-flight asks without creating anything."""
    root = os.path.dirname(os.path.abspath(cache))
    existing = root
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    fix = "set data.cache_dir (or HARNESS_CACHE) to a writable directory"
    if not os.path.isdir(existing):
        raise ConfigError(f"the data cache directory '{root}' cannot be created: '{existing}' is a file; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"the data cache directory '{existing}' is not writable for this user; {fix}")
    if create:
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"the data cache directory '{root}' cannot be created ({exc.strerror or type(exc).__name__}); {fix}"
            ) from None
