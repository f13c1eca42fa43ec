"""A stop request before the first step ends the run at once, through the user's entry point.

Before the first step there is nothing to save, so SIGTERM (a scheduler's) and SIGINT (a user's
Ctrl-C) end the run within seconds: one line naming the phase, exit 0 (so a requeue is allowed),
on every rank, nothing of the user's written. Each phase is real where it can be on CPU: the wait
on a live extension build lock (a lock file nobody removes), the data cache's preparation (a
corpus that takes seconds to tokenize), a rank waiting for a peer that never joins (blocked in
C, where no Python handler runs). The model's load is made long by `HARNESS_FAULT=load_pause`
(a drill's slow file system): the load itself is seconds here.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from launching import env, free_port, signal_once_logged, tiny_config

STOP_BOUND_S = 15  # from the signal to the exit: Python's startup is not in it, a step boundary minutes away would be
SIGNALS = [signal.SIGTERM, signal.SIGINT]


def _ranks(cfg: Path, world: int, extra: dict[str, str], started: int | None = None) -> tuple[list[list[str]], dict[str, str]]:
    """`world` ranks started as srun starts tasks (environment variables, no agent); `started` of them."""
    port = str(free_port())
    base = env() | extra | {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    cmds = []
    for rank in range(world if started is None else started):
        cmds.append(["env", f"RANK={rank}", f"LOCAL_RANK={rank}", sys.executable, "-m", "harness.train", "--config", str(cfg)])
    return cmds, base


def _stopped(results: list[tuple[int, float, str]], sig: int | list[int], phase: str) -> None:
    sigs = sig if isinstance(sig, list) else [sig] * len(results)
    for (code, seconds, out), one in zip(results, sigs):
        assert code == 0, out[-3000:]
        assert seconds < STOP_BOUND_S, (seconds, out[-3000:])
        assert f"stop requested ({signal.Signals(one).name}) while {phase}" in out, out[-3000:]
        assert "no step has run, so there is nothing to save" in out and "Traceback" not in out, out[-3000:]


def test_a_stop_while_ranks_wait_for_an_extension_build_lock_ends_them_at_once(tmp_path, data_cache):
    """Two ZeRO-2 ranks wait on a live build lock (another build may own it: it is never removed);
    rank 0 gets SIGTERM, rank 1 SIGINT (each rank waits on its own, so one launch shows both signals)."""
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    cfg = tiny_config(tmp_path / "run.yaml", data_cache, tmp_path / "out", strategy="zero2")
    knobs = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "HARNESS_BUILD_LOCK_WAIT_S": "600"}
    cmds, e = _ranks(cfg, 2, knobs)
    results = signal_once_logged(cmds, tmp_path, "waiting for the extension build lock", SIGNALS, e)
    _stopped(results, SIGNALS, "building the deepspeed engine")
    assert lock.exists() and not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_while_the_model_loads_ends_the_run_at_once(tmp_path, data_cache, sig):
    cfg = tiny_config(tmp_path / "run.yaml", data_cache, tmp_path / "out")
    cmd = [sys.executable, "-m", "harness.train", "--config", str(cfg)]
    results = signal_once_logged([cmd], tmp_path, "the model's load is held", sig, env() | {"HARNESS_FAULT": "load_pause=600"})
    _stopped(results, sig, "building the single engine and loading the model")


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_while_the_data_is_prepared_ends_the_run_and_leaves_no_cache(tmp_path, tokenizer_dir, sig):
    """A fresh cache of a ~6 MB corpus (seconds of tokenizing on one core): nothing of it is kept."""
    corpus = tmp_path / "corpus.jsonl"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron".split()
    with open(corpus, "w") as f:
        for i in range(12000):
            f.write(json.dumps({"text": f"doc {i} " + " ".join(words[(i * 7 + k) % 12] for k in range(80))}) + "\n")
    cache = tmp_path / "cache"
    data = {"data.source": str(corpus), "data.tokenizer": str(tokenizer_dir), "data.num_proc": 1, "data.max_tokens": None}
    cfg = tiny_config(tmp_path / "run.yaml", cache, tmp_path / "out", **data)
    cmd = [sys.executable, "-m", "harness.train", "--config", str(cfg)]
    results = signal_once_logged([cmd], tmp_path, "preparing the data cache", sig, env())
    _stopped(results, sig, "preparing the data")
    assert not [p for p in cache.rglob("*") if p.is_dir() and (p / "meta.json").exists()], "a cache was left"
    assert not list(cache.glob("**/*.tmp-*")), "a half-written cache was left"


def test_a_stop_while_waiting_for_a_peer_that_never_joins_ends_the_rank(tmp_path, data_cache):
    """Rank 0 of 2 alone, blocked in the rendezvous (in C, where no Python handler runs until it
    returns): the stop still ends it, after the bounded grace, in one line and exit 0."""
    cfg = tiny_config(tmp_path / "run.yaml", data_cache, tmp_path / "out")
    cmds, e = _ranks(cfg, 2, {"HARNESS_STOP_GRACE_S": "2"}, started=1)
    results = signal_once_logged(cmds, tmp_path, "joining a process group of 2 ranks", signal.SIGTERM, e)
    _stopped(results, signal.SIGTERM, "joining the process group")
