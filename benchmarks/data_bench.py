"""Data preparation at size: `python -m harness.data` against `datasets.map(batched, num_proc)`
with the same tokenizer, in the same run, on JSON-lines corpora of the requested sizes.

    python benchmarks/data_bench.py --sizes 100 1000 --work runs/data_bench [--out benchmarks/results/data/table.md]

The corpora are made here (no download): the standard library's Python sources cut into
~4,000-character documents, repeated with a per-copy prefix until the size is reached, so
every document is distinct. The tokenizer is a 32,000-entry byte-level BPE trained once on
the embedded corpus and saved to disk; both sides load it from there. Peak RSS is measured
by the kernel (wait4) for each process tree: the parent's own peak and the largest child's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BASELINE = """
import json, sys, time, resource
import datasets
from transformers import AutoTokenizer
corpus, tok_dir, num_proc = sys.argv[1], sys.argv[2], int(sys.argv[3])
datasets.disable_caching()
tok = AutoTokenizer.from_pretrained(tok_dir)
t0 = time.perf_counter()
ds = datasets.load_dataset("json", data_files=corpus, split="train")
t1 = time.perf_counter()
out = ds.map(lambda b: {"input_ids": tok(b["text"], add_special_tokens=False)["input_ids"]}, batched=True, batch_size=1000,
             num_proc=num_proc, remove_columns=["text"])
t2 = time.perf_counter()
import pyarrow.compute as pc
tokens = int(pc.sum(pc.list_value_length(out.data.column("input_ids"))).as_py())
rss = {"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
       "workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}
print(json.dumps({"load_s": t1 - t0, "map_s": t2 - t1, "seconds": t2 - t0, "tokens": tokens, "peak_rss_bytes": rss}))
"""


def make_corpus(path: Path, megabytes: int) -> int:
    """JSON lines of distinct ~4,000-character documents; returns the file's size in bytes."""
    if path.exists():
        return path.stat().st_size
    stdlib = os.path.dirname(os.__file__)
    pieces: list[str] = []
    for source in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        text = open(source, encoding="utf-8", errors="replace").read()
        pieces += [text[i : i + 4000] for i in range(0, len(text), 4000)]
    target, written, copy = megabytes * 10**6, 0, 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        while written < target:
            for i, piece in enumerate(pieces):
                line = json.dumps({"text": f"[copy {copy} part {i}]\n{piece}"}) + "\n"
                f.write(line)
                written += len(line.encode())
                if written >= target:
                    break
            copy += 1
    tmp.rename(path)
    return path.stat().st_size


def make_tokenizer(path: Path) -> None:
    if (path / "tokenizer.json").exists():
        return
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from harness.data import embedded_documents; "
            "from harness.data.tokenizer import train_bpe_tokenizer; "
            "train_bpe_tokenizer([embedded_documents()], 32000, sys.argv[1])",
            str(path),
        ],
        check=True,
        cwd=REPO,
    )


def measure(cmd: list[str], env: dict[str, str], logs: Path) -> tuple[dict, float, int]:
    """Run; return (its last-line JSON, wall seconds, the largest RSS of any process in its tree,
    from wait4: the process and every descendant it waited for)."""
    t0 = time.perf_counter()
    with open(logs.with_suffix(".out"), "w") as out, open(logs.with_suffix(".err"), "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{logs.with_suffix('.err').read_text()[-3000:]}")
    return json.loads(logs.with_suffix(".out").read_text().strip().splitlines()[-1]), wall, usage.ru_maxrss * 1024


def run_size(work: Path, size: int, tok: Path, num_proc: int) -> dict:
    corpus = work / f"corpus_{size}mb.jsonl"
    nbytes = make_corpus(corpus, size)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(work / "hf_cache")
    )
    cache = work / f"cache_{size}"
    if cache.exists():
        subprocess.run(["rm", "-rf", str(cache)], check=True)
    ours_cmd = [
        sys.executable,
        "-m",
        "harness.data",
        f"data.source={corpus}",
        f"data.tokenizer={tok}",
        "data.seq_len=1024",
        f"data.cache_dir={cache}",
        f"data.num_proc={num_proc}",
    ]
    ours, ours_wall, ours_tree = measure(ours_cmd, env, work / f"ours_{size}")
    base, base_wall, base_tree = measure(
        [sys.executable, "-c", BASELINE, str(corpus), str(tok), str(num_proc)], env, work / f"baseline_{size}"
    )
    return {
        "size_mb": size,
        "bytes": nbytes,
        "ours": ours,
        "ours_wall_s": ours_wall,
        "ours_tree_max_rss": ours_tree,
        "baseline": base,
        "baseline_wall_s": base_wall,
        "baseline_tree_max_rss": base_tree,
    }


def table(rows: list[dict], num_proc: int) -> str:
    gib = 2**30
    lines = [
        "| corpus | tool | seconds | MB/s | tokens/s | peak RSS: parent | largest worker | any process (wait4) | tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        o, b = r["ours"], r["baseline"]
        mb = r["bytes"] / 1e6
        lines.append(
            f"| {r['size_mb']} MB | harness.data | {o['prepare_seconds']:.1f} | {mb / o['prepare_seconds']:.2f} | "
            f"{o['tokens'] / o['prepare_seconds']:,.0f} | {o['peak_rss_bytes']['self'] / gib:.2f} GiB | "
            f"{o['peak_rss_bytes']['tokenizer_processes'] / gib:.2f} GiB | {r['ours_tree_max_rss'] / gib:.2f} GiB | "
            f"{o['tokens']:,} |"
        )
        tokens = b["tokens"]
        lines.append(
            f"| {r['size_mb']} MB | datasets load + map(num_proc={num_proc}) | {b['seconds']:.1f} | {mb / b['seconds']:.2f} | "
            f"{tokens / b['seconds']:,.0f} | {b['peak_rss_bytes']['self'] / gib:.2f} GiB | "
            f"{b['peak_rss_bytes']['workers'] / gib:.2f} GiB | {r['baseline_tree_max_rss'] / gib:.2f} GiB | {b['tokens']:,} |"
        )
        lines.append(
            f"| {r['size_mb']} MB | ratio (ours / baseline throughput) | | **{b['seconds'] / o['prepare_seconds']:.2f}x** | "
            f"| | | | {kept(o, b)} |"
        )
    return "\n".join(lines)


def kept(ours: dict, base: dict) -> str:
    """Ours = the baseline's tokens + one EOS per document, or the counts differ."""
    docs = sum(ours["documents"].values())
    return "every token kept (+1 EOS per document)" if ours["tokens"] == base["tokens"] + docs else "TOKEN COUNTS DIFFER"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--work", default="runs/data_bench")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tok = work / "tokenizer32k"
    make_tokenizer(tok)
    rows = [run_size(work, size, tok, args.num_proc) for size in args.sizes]
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    text = f"Machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}; num_proc={args.num_proc}\n\n" + table(
        rows, args.num_proc
    )
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
