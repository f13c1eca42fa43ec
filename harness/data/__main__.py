"""Prepare a run's data cache on its own, so a cluster job does not spend GPU time tokenizing.

    python -m harness.data --config run.yaml [key=value ...]

The last line printed is a JSON object: tokens (all splits), tokens per split, documents,
input bytes, seconds, MB/s, tokens/s, peak RSS (this process and its tokenizer processes,
the largest of each) and the cache path. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from harness import imports_done  # the package first: as the program, the imports below run with the collector held
from harness.config import load_config
from harness.data.cache import is_complete, load_packed, prepare_data
from harness.errors import command_errors


@command_errors("harness.data")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harness.data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="run config (YAML or JSON); key=value overrides follow")
    args, overrides = parser.parse_known_args(argv)
    t0 = time.perf_counter()
    cfg = load_config(args.config, overrides)
    cache = prepare_data(cfg.model.name, cfg.data, progress=True)
    seconds = time.perf_counter() - t0
    data = load_packed(cache, block_bos=cfg.data.block_bos)
    with open(f"{cache}/meta.json") as f:
        meta = json.load(f)
    tokens = sum(data.tokens.values())
    prepared = meta["seconds"] if is_complete(cache) else seconds
    rss = {
        "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tokenizer_processes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }
    print(
        json.dumps(
            {
                "tokens": tokens,
                "tokens_per_split": data.tokens,
                "documents": meta["documents"],
                "bytes": meta["bytes"],
                "seconds": round(seconds, 3),
                "prepare_seconds": round(prepared, 3),
                "mb_per_s": round(meta["bytes"] / 1e6 / max(prepared, 1e-9), 3),
                "tokens_per_s": round(tokens / max(prepared, 1e-9), 1),
                "peak_rss_bytes": rss,
                "cache": cache,
            }
        )
    )
    return 0


if __name__ == "__main__":
    imports_done()
    sys.exit(main())
