"""Preparing data through the user's entry points: `python -m harness.data` (its JSON line), a
preparer killed midway (redone, never trusted), two preparers of one cache (one tokenizes,
the other waits and says for whom), and a streamed run under torchrun that resumes from a
checkpoint at exactly the sample it stopped at (losses bit-identical to an unbroken run)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import REPO, env, launch_command, run, tiny_config

from harness.data import embedded_documents
from harness.observability.metrics import read_records


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """~6 MB of JSON lines (long enough to kill a preparation midway) and a saved tokenizer (the session's)."""
    root = tmp_path_factory.mktemp("data")
    docs = embedded_documents()
    with open(root / "docs.jsonl", "w") as f:
        for k in range(2):
            for d in docs:
                f.write(json.dumps({"text": f"copy {k}: {d}"}) + "\n")
    return {"root": root, "docs": root / "docs.jsonl", "tok": tokenizer_dir}


def _data_cmd(corpus: dict[str, Path], cache: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "harness.data",
        f"data.source={corpus['docs']}",
        f"data.tokenizer={corpus['tok']}",
        "data.seq_len=32",
        f"data.cache_dir={cache}",
        "data.num_proc=2",
        *extra,
    ]


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _preparing(outs: list[tuple[str, str]]) -> list[str]:
    """The stdout of each process that tokenized (the other waited for it)."""
    return [o for o, _ in outs if "[harness] data: " in o and " tokens (train " in o]


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> tuple[Path, dict, list[tuple[str, str]]]:
    """Two preparers of one cache started at once, by the command: one tokenizes, the other waits for
    it. Returns the cache directory, the tokenizing one's JSON line and both outputs: the two-preparer
    test reads the outputs, the CLI test the line, and the killed-preparation test compares its redone
    streams against the cache."""
    cache = tmp_path_factory.mktemp("prepared")
    procs = [
        subprocess.Popen(_data_cmd(corpus, cache), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    tokenized = _preparing(outs)
    return cache, _last_json(tokenized[0] if tokenized else outs[0][0]), outs


def test_cli_prints_the_cache_as_its_last_line(corpus, prepared):
    cache, info, _ = prepared
    assert info["tokens"] == sum(info["tokens_per_split"].values()) > 1_000_000
    assert info["seconds"] > 0 and info["tokens_per_s"] > 0 and info["bytes"] > 5_000_000
    assert (Path(info["cache"]) / "meta.json").is_file()
    again = _last_json(run(_data_cmd(corpus, cache), timeout=600).stdout)  # cached: the same answer, at once
    assert again["cache"] == info["cache"] and again["tokens"] == info["tokens"] and again["seconds"] < info["seconds"]


def test_a_preparation_killed_midway_is_redone_not_trusted(corpus, prepared, tmp_path):
    proc = subprocess.Popen(_data_cmd(corpus, tmp_path), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("data-*.tmp-*/train.bin")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # well into tokenizing
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list(tmp_path.glob("data-*/meta.json")), "a killed preparation must leave nothing that looks complete"
    assert list(tmp_path.glob("data-*.tmp-*")) and list(tmp_path.glob("data-*.lock"))
    redone = run(_data_cmd(corpus, tmp_path), timeout=600)
    assert "stopped; preparing it again" in redone.stderr
    assert not list(tmp_path.glob("data-*.tmp-*")) and not list(tmp_path.glob("data-*.lock"))
    clean = prepared[1]  # the same data config prepared once, never interrupted
    info = _last_json(redone.stdout)
    assert Path(info["cache"]).name == Path(clean["cache"]).name and info["cache"] != clean["cache"]
    for split in ("train", "eval", "calib"):
        assert (Path(info["cache"]) / f"{split}.bin").read_bytes() == (Path(clean["cache"]) / f"{split}.bin").read_bytes()


def test_two_preparers_of_one_cache_tokenize_once(prepared):
    outs = prepared[2]
    waited = [o for o, _ in outs if "waiting for" in o and "to finish preparing the data cache" in o]
    assert len(_preparing(outs)) == 1 and len(waited) == 1, outs
    assert _last_json(outs[0][0])["cache"] == _last_json(outs[1][0])["cache"]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_records(str(out / "metrics.jsonl")) if "train/loss" in r}


def test_streamed_run_resumes_at_the_sample_it_stopped_at(corpus, tmp_path):
    """Resumed from step 2 of an unbroken 4-step run, steps 3 and 4 see the same batches: had the
    stream position not been restored, each rank would read its part from the start again."""
    common = {
        "data.source": str(corpus["docs"]),
        "data.tokenizer": str(corpus["tok"]),
        "data.streaming": True,
        "data.max_tokens": None,
        "data.stream_eval_blocks": 8,
        "checkpoint.every": 2,
    }
    straight = tiny_config(tmp_path / "straight.yaml", tmp_path / "cache", tmp_path / "straight", steps=4, **common)
    run(launch_command("torchrun", 2, straight, []), timeout=600)
    saved = tmp_path / "straight" / "checkpoints" / "step_00000002"
    assert (saved / "data" / "rank00001.pt").is_file()
    again = tiny_config(tmp_path / "again.yaml", tmp_path / "cache", tmp_path / "again", steps=4, **common)
    out = run(launch_command("torchrun", 2, again, [f"checkpoint.resume={saved}"]), timeout=600)
    assert f"resumed from {saved} at step 2" in out.stdout
    a, b = _losses(tmp_path / "straight"), _losses(tmp_path / "again")
    assert set(b) == {3, 4} and all(a[s] == b[s] for s in (3, 4)), (a, b)
    same_batch = [f"checkpoint.resume={saved}", "output_dir=" + str(tmp_path / "w1"), "grad_accum=4"]  # only the world differs
    at_other_world = run(launch_command("python", 1, again, same_batch), timeout=300, check=False)
    assert at_other_world.returncode == 2 and "resumes at that world size" in at_other_world.stderr
