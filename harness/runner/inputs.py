"""Pre-flight checks of what comes from outside the config: the launcher's environment and
harness's own `HARNESS_*` knobs, a sharded model's index, a tokenizer directory.

Each would otherwise fail after the process group started: a garbage `RANK` or a rank outside
the world waits the whole collective timeout for ranks that never come; a knob of 'abc'
seconds is a traceback mid-run; a missing shard or a broken tokenizer is a traceback on
every rank while the model loads or the data is prepared.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

from harness.distributed import launch_env
from harness.errors import ConfigError, env_seconds
from harness.faults import check_faults
from harness.log import LEVELS


def check_environment() -> int:
    """The launcher's variables and harness's own `HARNESS_*` knobs; returns the world size.
    Garbage in any of them is one line here, not a traceback or an unbounded wait later."""
    _, world, _ = launch_env()
    for knob, default in SECONDS_KNOBS.items():
        env_seconds(knob, default)
    level = os.environ.get("HARNESS_LOG_LEVEL")
    if level is not None and level.strip().upper() not in LEVELS:
        raise ConfigError(f"HARNESS_LOG_LEVEL={level!r} is not one of {', '.join(LEVELS)}")
    if os.environ.get("HARNESS_DS_CPU_ADAM", "1") not in ("0", "1"):
        raise ConfigError(f"HARNESS_DS_CPU_ADAM={os.environ['HARNESS_DS_CPU_ADAM']!r} must be 0 or 1")
    try:
        check_faults()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return world


# Every `HARNESS_*` knob that is a number of seconds, and its default.
SECONDS_KNOBS = {
    "HARNESS_COLLECTIVE_TIMEOUT_S": 600.0,
    "HARNESS_PEER_TIMEOUT_S": 30.0,
    "HARNESS_LOCK_STALE_S": 120.0,
    "HARNESS_BUILD_LOCK_STALE_S": 300.0,
    "HARNESS_BUILD_LOCK_WAIT_S": 900.0,
    "HARNESS_STOP_GRACE_S": 5.0,
}


def check_index(model_dir: str, index: str) -> None:
    """A sharded checkpoint's index parses and every shard it names is in the directory."""
    try:
        with open(index, encoding="utf-8") as f:
            shards = set(json.load(f)["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"model index '{index}' is not a valid shard index ({type(exc).__name__}); download it again") from None
    missing = sorted(s for s in shards if not os.path.isfile(os.path.join(model_dir, str(s))))
    if missing:
        raise ConfigError(
            f"model index '{index}' names {len(missing)} shard(s) missing from {model_dir} ({', '.join(missing[:3])}); download them again"
        )


def check_tokenizer_dir(directory: str, what: str) -> None:
    """A tokenizer directory holds a tokenizer file that parses (a broken or half-copied one is one
    line here, not a traceback on every rank while the data is prepared)."""
    fast = os.path.join(directory, "tokenizer.json")
    slow = [n for n in ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model") if os.path.isfile(os.path.join(directory, n))]
    if not os.path.isfile(fast) and not slow:
        raise ConfigError(
            f"{what} '{directory}' holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json); give a tokenizer directory"
        )
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{what}: '{path}' is not valid JSON ({str(exc).splitlines()[0][:120]}); copy it again") from None
    if os.path.isfile(fast):
        try:
            Tokenizer.from_file(fast)
        except Exception as exc:  # the Rust parser reports any malformed file as a generic Exception
            raise ConfigError(f"{what}: '{fast}' cannot be read as a tokenizer ({str(exc).splitlines()[0][:120]}); copy it again") from None
