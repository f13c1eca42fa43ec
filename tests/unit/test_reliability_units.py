"""The in-process half of the reliability battery (tests/integration/test_reliability_battery.py
is the other): bounded waits on an extension build lock, stop signals during data
preparation (a real tokenizer pool), the data cache keyed by content and verified on load,
mixed source directories, bytes that are not UTF-8 past pre-flight's sample, a cache that
cannot be written, the non-finite skip bound, an earlier run's metrics kept. Each case a real
input; notes/reliability.md counts them by class.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.config import CheckpointConfig, DataConfig
from harness.data import cache_dir_for, is_complete, load_packed, prepare_data, stop_preparation_when
from harness.data.documents import data_files, open_documents
from harness.engine.extension_lock import build_locks, clear_build_locks, guarded_builds
from harness.errors import ConfigError, NonFiniteError, StopRequested
from harness.reliability import signals

# ------------------------------------------------------------------ class 2: the extension build lock


def _lock(root: Path, sub: str, age_s: float = 0.0) -> Path:
    lock = root / sub / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    (lock.parent / "build.ninja").write_text("rule cc\n")
    old = time.time() - age_s
    for p in lock.parent.iterdir():
        os.utime(p, (old, old))
    return lock


@pytest.mark.parametrize("sub", ["cpu_adam", "py311_cpu/cpu_adam"])
def test_class2_a_stale_build_lock_is_removed_and_named(tmp_path, monkeypatch, caplog, sub):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _lock(tmp_path, sub, age_s=3600)
    with caplog.at_level(logging.WARNING, logger="harness"):
        clear_build_locks(poll_s=0.05)
    assert not lock.exists()
    assert any(f"removed the stale extension build lock {lock}" in r.getMessage() for r in caplog.records)


def test_class2_a_recent_build_lock_is_waited_for_with_a_bound_and_named(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("HARNESS_BUILD_LOCK_WAIT_S", "0.6")
    lock = _lock(tmp_path, "cpu_adam")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="harness"), pytest.raises(ConfigError, match=f"remove {lock}"):
        clear_build_locks(poll_s=0.05)
    assert time.monotonic() - t0 < 5 and lock.exists()  # bounded, and not removed: it may be a live build
    assert any(f"waiting for the extension build lock {lock}" in r.getMessage() for r in caplog.records)


def test_class2_an_old_lock_with_a_live_builder_is_not_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("HARNESS_BUILD_LOCK_WAIT_S", "0.5")
    lock = _lock(tmp_path, "cpu_adam", age_s=3600)
    builder = subprocess.Popen(["sleep", "30"], cwd=lock.parent)  # what ninja looks like: a process working there
    try:
        with pytest.raises(ConfigError, match="is still held after"):
            clear_build_locks(poll_s=0.05)
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()


def test_class2_a_lock_released_while_waiting_ends_the_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _lock(tmp_path, "cpu_adam")
    threading.Timer(0.3, lock.unlink).start()
    t0 = time.monotonic()
    clear_build_locks(poll_s=0.05)
    assert 0.2 < time.monotonic() - t0 < 5


def _baton_wait(lock: Path, bound_s: float) -> None:
    """What torch's FileBaton.wait does (poll until the file is gone), with a bound for the test."""
    t0 = time.monotonic()
    while lock.exists():
        assert time.monotonic() - t0 < bound_s, "the guarded wait did not end"
        time.sleep(0.02)


def test_class2_a_build_killed_while_this_process_waits_is_not_waited_for(tmp_path, monkeypatch, caplog):
    """The lock appears after the start check (another process began building), then its build is
    killed: the watchdog removes it once provably stale, and the baton's poll ends."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("HARNESS_BUILD_LOCK_STALE_S", "0.5")
    with caplog.at_level(logging.WARNING, logger="harness"), guarded_builds(poll_s=0.05):
        lock = _lock(tmp_path, "cpu_adam", age_s=3600)  # created, then left: no process builds there
        _baton_wait(lock, 10)
    assert any(f"removed the stale extension build lock {lock} while DeepSpeed waited" in r.getMessage() for r in caplog.records)


def test_class2_a_lock_nobody_here_builds_ends_the_guarded_wait_in_one_line(tmp_path, monkeypatch):
    """A lock kept fresh (a build on another node sharing the directory, or a wedged one) and no
    builder on this host: the wait ends after HARNESS_BUILD_LOCK_WAIT_S with the line naming the
    file, and the lock is left where it is."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("HARNESS_BUILD_LOCK_WAIT_S", "0.5")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="is still held after .* remove .*cpu_adam/lock"), guarded_builds(poll_s=0.05):
        lock = _lock(tmp_path, "cpu_adam")
        _baton_wait(lock, 30)
    assert time.monotonic() - t0 < 10 and lock.exists()


def test_class2_a_live_build_here_is_waited_for(tmp_path, monkeypatch):
    """A builder on this host (ninja's working directory is the build's): not stale, not cut
    short by the wait bound; the guarded wait ends when the build releases the lock."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("HARNESS_BUILD_LOCK_WAIT_S", "0.2")
    monkeypatch.setenv("HARNESS_BUILD_LOCK_STALE_S", "0.2")
    with guarded_builds(poll_s=0.05):
        lock = _lock(tmp_path, "cpu_adam", age_s=3600)
        builder = subprocess.Popen(["sleep", "30"], cwd=lock.parent)
        try:
            threading.Timer(1.0, lock.unlink).start()
            t0 = time.monotonic()
            _baton_wait(lock, 10)
            assert time.monotonic() - t0 > 0.8  # waited the build out: neither removed nor interrupted
        finally:
            builder.kill()
            builder.wait()


def test_class2_no_locks_no_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "none"))
    assert build_locks() == []
    clear_build_locks()


# ------------------------------------------------------------------ class 2/4: signals


@pytest.fixture
def harness_handlers():
    """The run's stop handlers installed in this process as a run has them once steps run, then restored."""
    with signals.stop_requests("a test"):
        signals.steps_begin()
        yield


def test_class2_a_stop_before_the_first_step_ends_the_phase_at_once_naming_it():
    """Loading, waiting, preparing: no step to save at, so the stop is not deferred to one."""
    before = signal.getsignal(signal.SIGTERM)
    with signals.stop_requests("loading the model"):
        t0 = time.monotonic()
        with pytest.raises(StopRequested, match=r"stop requested \(SIGTERM\) while loading the model; no step has run"):
            os.kill(os.getpid(), signal.SIGTERM)
            while time.monotonic() - t0 < 10:  # a long Python-level phase
                time.sleep(0.01)
        assert time.monotonic() - t0 < 2
        signals.entering("preparing the data")
        with pytest.raises(StopRequested, match=r"\(SIGINT\) while preparing the data"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is before and not signals.signal_received()  # restored for the next caller


class _Finalized:
    """An object whose finalizer is where the stop signal's handler runs: it sends the signal and
    runs on, so the handler raises inside the finalizer, where Python swallows exceptions."""

    def __init__(self, sig: int, via_weakref: bool):
        self.sig = sig
        if via_weakref:
            self.ref = weakref.ref(_Referent(), self._finalize)  # the referent dies at once

    def _finalize(self, *_: object) -> None:
        signal.raise_signal(self.sig)  # the handler runs on this call's return, inside the finalizer
        for _ in range(100):
            pass

    def __del__(self) -> None:
        if not hasattr(self, "ref"):
            self._finalize()


class _Referent:
    pass


@pytest.mark.parametrize("via_weakref", [True, False], ids=["weakref-callback", "__del__"])
def test_class2_a_stop_raised_inside_a_finalizer_is_not_swallowed(capfd, monkeypatch, via_weakref):
    """Python swallows what a finalizer raises (a weakref callback, `__del__`), printing "Exception
    ignored in": a stop handled there would be lost and leave a traceback. It is raised where the
    main thread goes next, and nothing is printed; other unraisable errors still reach the previous hook."""
    monkeypatch.setenv("HARNESS_STOP_GRACE_S", "60")  # the watcher's exit would hide a lost stop (and end pytest)
    seen = []
    previous, hook = sys.unraisablehook, seen.append
    sys.unraisablehook = hook
    try:
        with signals.stop_requests("preparing the data"):
            t0 = time.monotonic()
            with pytest.raises(StopRequested, match=r"\(SIGTERM\) while preparing the data"):
                _Finalized(signal.SIGTERM, via_weakref)
                while time.monotonic() - t0 < 10:  # the phase goes on in Python, as a tokenizer does
                    pass
            assert time.monotonic() - t0 < 2
            _Raising()  # an error that is not a stop: the previous hook gets it
            signals.steps_begin()
            os.kill(os.getpid(), signal.SIGINT)  # once steps run: the first Ctrl-C is recorded, a second aborts
            time.sleep(0.05)
            with pytest.raises(KeyboardInterrupt):
                _Finalized(signal.SIGINT, via_weakref)
                time.sleep(2)
        assert [u.exc_type for u in seen] == [ValueError]
        assert sys.unraisablehook is hook  # restored
    finally:
        sys.unraisablehook = previous
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err


class _Raising:
    def __del__(self) -> None:
        raise ValueError("a finalizer's own error")


def test_class2_once_steps_run_a_stop_is_only_recorded_for_the_step_boundary():
    with signals.stop_requests("building the engine"):
        signals.steps_begin()
        signals.entering("restoring")  # no way back to stopping at once: a checkpoint may be being written
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert signals.signal_received()


def test_class2_the_guarded_build_wait_ends_under_the_runs_own_stop_handlers(tmp_path, monkeypatch):
    """Every run installs its stop handlers before the engine is built: the bounded wait on a build
    lock must not depend on which SIGINT handler is installed (a handler that turns SIGINT into a
    stop request would swallow an interrupt and the wait would never end)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("HARNESS_BUILD_LOCK_WAIT_S", "0.5")
    for phase in ("building the deepspeed engine", None):  # before the first step, and once steps run
        with signals.stop_requests("a test"):
            if phase is None:
                signals.steps_begin()
            t0 = time.monotonic()
            with pytest.raises(ConfigError, match="is still held after"), guarded_builds(roots=[str(tmp_path)], poll_s=0.05):
                lock = _lock(tmp_path, "cpu_adam")
                _baton_wait(lock, 8)
            assert time.monotonic() - t0 < 8 and lock.exists() and not signals.signal_received()
        lock.unlink()


def test_class2_each_python_environment_builds_extensions_in_its_own_folder(tmp_path, monkeypatch, caplog):
    from harness.engine import extension_lock

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours = extension_lock.environment_extensions_dir()
    monkeypatch.setattr(extension_lock.sys, "prefix", str(tmp_path / "another-venv"))
    theirs = extension_lock.environment_extensions_dir()
    assert ours != theirs and os.path.dirname(ours) == os.path.dirname(theirs) == str(tmp_path / "torch_extensions")
    with caplog.at_level(logging.INFO, logger="harness"), guarded_builds(poll_s=0.05):
        assert os.environ["TORCH_EXTENSIONS_DIR"] == theirs
    assert sum("this environment's own folder" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))  # the user's choice is kept, silently
    with guarded_builds(poll_s=0.05):
        assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")


def test_class4_ctrl_c_is_a_stop_request_and_a_second_one_aborts(harness_handlers, capfd):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert signals.signal_received()
    assert "Ctrl-C: stopping at the next step boundary" in capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("rel-corpus")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    with open(root / "docs.jsonl", "w") as f:
        for i in range(6000):
            f.write(json.dumps({"text": f"doc {i} " + " ".join(words[(i + k) % 10] for k in range(60))}) + "\n")
    return root / "docs.jsonl", Path(tokenizer_dir)


def _cfg(tmp: Path, source: Path, tok: Path, **kw) -> DataConfig:
    return DataConfig(**{"source": str(source), "seq_len": 32, "tokenizer": str(tok), "cache_dir": str(tmp / "cache"), "num_proc": 1, **kw})


def test_class2_a_stop_signal_while_the_pool_tokenizes_ends_it_and_its_workers(tmp_path, corpus, harness_handlers):
    """A real pool of 2 (6 tasks), the run's handlers installed: the workers must not inherit them
    (else the pool's terminate waits for ever on workers that ignore SIGTERM)."""
    import multiprocessing

    source, tok = corpus
    batches = {"n": 0}

    def after_first_batch() -> bool:
        batches["n"] += 1
        return batches["n"] > 1

    stop_preparation_when(after_first_batch)
    cfg = _cfg(tmp_path, source, tok, num_proc=2)
    t0 = time.monotonic()
    try:
        with pytest.raises(StopRequested, match="while tokenizing the data cache"):
            prepare_data("tiny-llama", cfg, progress=False)
    finally:
        stop_preparation_when(lambda: False)
    assert time.monotonic() - t0 < 60
    assert not multiprocessing.active_children()
    assert not is_complete(cache_dir_for("tiny-llama", cfg)) and not list((tmp_path / "cache").glob("*.tmp-*"))


def test_class2_a_stop_signal_while_waiting_for_another_preparer_ends_the_wait(tmp_path, corpus):
    from harness.distributed import FileLock

    source, tok = corpus
    cfg = _cfg(tmp_path, source, tok)
    cache = cache_dir_for("tiny-llama", cfg)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    other = FileLock(cache + ".lock", what="another preparer")
    assert other.try_acquire()
    stop_preparation_when(lambda: True)
    try:
        with pytest.raises(StopRequested, match="waiting for another process"):
            prepare_data("tiny-llama", cfg, progress=False)
    finally:
        stop_preparation_when(lambda: False)
        other.release()


def _handlers_here() -> tuple:
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1)


def test_class2_pool_workers_do_not_inherit_the_runs_handlers(harness_handlers):
    import multiprocessing as mp

    from harness.data.cache import _worker_signals

    with mp.get_context("fork").Pool(1, initializer=_worker_signals) as pool:
        term, intr, usr1 = pool.apply(_handlers_here)
    assert (term, intr, usr1) == (signal.SIG_DFL, signal.SIG_IGN, signal.SIG_DFL)


# ------------------------------------------------------------------ class 4: the cache follows the content


EDITS = ["append_a_document", "same_size_rewrite", "touch_only", "file_added_to_directory", "file_removed_from_directory"]


@pytest.mark.parametrize("edit", EDITS)
def test_class4_a_corpus_edited_in_place_is_read_again(tmp_path, tokenizer_dir, edit):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"part{i}.jsonl").write_text("".join(json.dumps({"text": f"part {i} line {k} " * 20}) + "\n" for k in range(60)))
    cfg = _cfg(tmp_path, src, Path(tokenizer_dir), eval_fraction=0.2, calib_fraction=0.2)
    first = cache_dir_for("tiny-llama", cfg)
    tokens = load_packed(prepare_data("tiny-llama", cfg, progress=False)).tokens
    target = src / "part0.jsonl"
    if edit == "append_a_document":
        with open(target, "a") as f:
            f.write(json.dumps({"text": "a new document " * 30}) + "\n")
    elif edit == "same_size_rewrite":
        target.write_text(target.read_text().replace("part 0", "PART 0"))
    elif edit == "touch_only":
        os.utime(target, (time.time() + 5, time.time() + 5))
    elif edit == "file_added_to_directory":
        (src / "part9.jsonl").write_text(json.dumps({"text": "added " * 50}) + "\n")
    else:
        (src / "part2.jsonl").unlink()
    second = cache_dir_for("tiny-llama", cfg)
    assert second != first
    again = load_packed(prepare_data("tiny-llama", cfg, progress=False)).tokens
    if edit in ("append_a_document", "file_added_to_directory", "file_removed_from_directory"):
        assert sum(again.values()) != sum(tokens.values())


DAMAGE = [
    ("train_stream_truncated", "train.bin"),
    ("eval_offsets_deleted", "eval.docs.npy"),
    ("tokenizer_truncated", os.path.join("tokenizer", "tokenizer.json")),
    ("meta_json_garbage", "meta.json"),
]


@pytest.mark.parametrize("name, file", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_class4_a_damaged_cache_is_prepared_again_not_failed_forever(tmp_path, corpus, caplog, name, file):
    source, tok = corpus
    cfg = _cfg(tmp_path, source, tok, max_tokens=20000)
    cache = prepare_data("tiny-llama", cfg, progress=False)
    good = (Path(cache) / "train.bin").read_bytes()
    path = Path(cache) / file
    if name.endswith("deleted"):
        path.unlink()
    elif name == "meta_json_garbage":
        path.write_text("{")
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert not is_complete(cache)
    with caplog.at_level(logging.WARNING, logger="harness"):
        again = prepare_data("tiny-llama", cfg, progress=False)
    assert again == cache and is_complete(cache) and (Path(cache) / "train.bin").read_bytes() == good
    assert name == "meta_json_garbage" or any("is damaged" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ class 4: mixed directories; class 3: unreadable sources


def test_class4_a_readme_beside_the_data_is_left_out_and_said(tmp_path, caplog):
    (tmp_path / "README.md").write_text("# my dataset\n")
    (tmp_path / "LICENSE").write_text("MIT\n")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    with caplog.at_level(logging.INFO, logger="harness"):
        files = data_files(str(tmp_path))
    assert [os.path.basename(f) for f in files] == ["a.jsonl", "b.jsonl"]
    assert any("left out LICENSE, README.md" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "names, expected",
    [
        (["a.jsonl", "b.csv"], "mixes files of 2 kinds (csv: b.csv; json: a.jsonl)"),
        (["a.parquet", "notes.txt"], "mixes files of 2 kinds"),
        (["a.jsonl", "b.txt", "c.csv"], "mixes files of 3 kinds"),
    ],
)
def test_class4_a_directory_of_several_loaders_is_refused(tmp_path, names, expected):
    for n in names:
        (tmp_path / n).write_text("x\n")
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        data_files(str(tmp_path))


def test_class4_a_csv_directory_is_read_as_csv(tmp_path, tokenizer_dir):
    src = tmp_path / "csv"
    src.mkdir()
    (src / "a.csv").write_text("text,label\n" + "".join(f'"row {i} ' + "some words " * 30 + f'",{i}\n' for i in range(300)))
    cfg = _cfg(tmp_path, src, Path(tokenizer_dir), eval_fraction=0.2, calib_fraction=0.2)
    data = load_packed(prepare_data("tiny-llama", cfg, progress=False))
    assert sum(data.tokens.values()) > 300 * 30


LATE = [("jsonl", False), ("txt", True), ("jsonl", True)]


@pytest.mark.parametrize("ext, streaming", LATE, ids=[f"{e}-{'stream' if s else 'cache'}" for e, s in LATE])
def test_class3_bytes_not_utf8_past_the_sample_are_one_line(tmp_path, tokenizer_dir, ext, streaming):
    from harness.data import StreamSampler
    from harness.data.tokenizer import load_tokenizer

    src = tmp_path / f"late.{ext}"
    if ext == "jsonl":
        src.write_bytes(b'{"text": "hello world and more"}\n' * 4000 + b'{"text": "bad \xff byte"}\n')
    else:
        src.write_bytes(b"hello world\n" * 7000 + b"bad \xff\xfe byte\n")
    cfg = _cfg(tmp_path, src, Path(tokenizer_dir), streaming=streaming, max_tokens=None)
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        if not streaming:
            prepare_data("tiny-llama", cfg, progress=False)
        else:
            sampler = StreamSampler(cfg, load_tokenizer(str(tokenizer_dir)), 0, 2, 1, 1, 0)
            for step in range(10000):
                sampler.batch(step, 0)
    assert not list((tmp_path / "cache").glob("*.tmp-*"))


def test_class3_a_full_disk_while_preparing_is_one_line(tmp_path, corpus, monkeypatch):
    """The file-size limit makes every write past 64 KiB fail as a full disk would (EFBIG for ENOSPC).
    Two writes can meet it: the datasets library's conversion of the file into its own cache (a
    source it has not seen, here in a cache of this test's own), then harness's data cache (the
    conversion found in the datasets cache, a second time). Each is named, with what to free or set."""
    import datasets

    source, tok = corpus
    cfg = _cfg(tmp_path, source, tok)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        for conversion_cached, named in ((False, "could not be converted: the datasets cache .*hf-datasets"), (True, "data cache")):
            if conversion_cached:
                open_documents(cfg)  # converted with room to spare
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
            try:
                with pytest.raises(ConfigError, match=f"{named}.* could not be written .*free space or set"):
                    prepare_data("tiny-llama", cfg, progress=False)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    finally:
        signal.signal(signal.SIGXFSZ, old)
    assert not list((tmp_path / "cache").glob("*.tmp-*"))


# ------------------------------------------------------------------ class 4: the non-finite skip bound; class 1: earlier metrics


class _Engine:
    steps_in_backward = False
    module = None


@pytest.fixture
def guard_of(monkeypatch):
    import harness.reliability.guard as g

    monkeypatch.setattr(g, "install_fault_hooks", lambda *a, **k: None)
    monkeypatch.setattr(g, "weights_finite", lambda *a, **k: True)
    monkeypatch.setattr(g, "signal_received", lambda: False)

    def make(bound: int, precision: str = "fp32"):
        engine = _Engine()
        engine.plan = SimpleNamespace(precision=SimpleNamespace(uses_scaler=precision == "fp16"))  # fp16's loss scaler
        return g.StepGuard(CheckpointConfig(max_consecutive_skips=bound), SimpleNamespace(rank=0, is_main=True), engine)

    return make


def _step(guard, finite: bool) -> None:
    guard._bad_loss = not finite
    guard.post_step(SimpleNamespace(grad_norm=1.0 if finite else float("nan"), skipped=not finite))


def test_class4_consecutive_skips_are_bounded_exit_3(guard_of):
    guard = guard_of(3)
    for finite in (False, False, True, False, False):  # a good step resets the count
        _step(guard, finite)
    with pytest.raises(NonFiniteError, match=r"in 3 consecutive steps \(4-6\)"):
        _step(guard, False)


def test_class4_a_run_of_only_skipped_steps_did_not_train(guard_of):
    guard = guard_of(10)
    _step(guard, False)
    _step(guard, False)
    with pytest.raises(NonFiniteError, match="every one of this run's 2 steps"):
        guard.finish(2)


def test_class4_a_run_with_one_good_step_finishes(guard_of):
    guard = guard_of(10)
    _step(guard, False)
    _step(guard, True)
    guard.finish(2)


# the step's one agreement (StepGuard.agree): the loss, the stop and the non-finite flags in one read


def test_the_agreement_carries_the_loss_and_skips_a_non_finite_loss_or_norm(guard_of):
    g = guard_of(5)
    agreed = g.agree(torch.tensor(2.5, dtype=torch.float64), torch.tensor(1.0))
    assert (agreed.skip, agreed.loss, g.stop_requested) == (False, 2.5, False)
    assert g.agree(torch.tensor(float("nan"), dtype=torch.float64), torch.tensor(1.0)).skip
    assert g._bad_loss
    g.post_step(SimpleNamespace(grad_norm=torch.tensor(1.0), skipped=True))
    assert (g.nonfinite_steps, g.consecutive) == (1, 1)
    agreed = g.agree(torch.tensor(2.0, dtype=torch.float64), torch.tensor(float("inf")))
    assert agreed.skip and not g._bad_loss
    g.post_step(SimpleNamespace(grad_norm=torch.tensor(float("inf")), skipped=True))  # the agreed flag, not a read
    assert (g.nonfinite_steps, g.consecutive) == (2, 2)
    g.agree(torch.tensor(2.0, dtype=torch.float64), torch.tensor(0.5))
    g.post_step(SimpleNamespace(grad_norm=torch.tensor(0.5), skipped=False))
    assert g.consecutive == 0


def test_fp16_overflow_is_skipped_but_not_counted_as_divergence(guard_of):
    g = guard_of(5, "fp16")
    assert g.agree(torch.tensor(2.0, dtype=torch.float64), torch.tensor(float("inf"))).skip  # the scaler's update still runs
    g.post_step(SimpleNamespace(grad_norm=torch.tensor(float("inf")), skipped=True))
    assert g.nonfinite_steps == 0


def test_a_stop_request_is_agreed(guard_of, monkeypatch):
    import harness.reliability.guard

    monkeypatch.setattr(harness.reliability.guard, "signal_received", lambda: True)
    stopper = guard_of(5)
    agreed = stopper.agree(torch.tensor(1.0, dtype=torch.float64), None)  # an engine that measures its norm in its step
    assert stopper.stop_requested and not agreed.skip
    stopper.post_step(SimpleNamespace(grad_norm=float("nan"), skipped=True))  # then the step's own float decides
    assert stopper.nonfinite_steps == 1


def test_class1_a_fresh_run_keeps_an_earlier_runs_metrics(tmp_path):
    from harness.observability.metrics import MetricsWriter

    old = '{"kind": "train", "step": 1, "train/loss": 5.0}\n{"kind": "train", "step": 2, "train/loss": 4.0}\n'
    (tmp_path / "metrics.jsonl").write_text(old)
    writer = MetricsWriter(str(tmp_path))
    writer.write("train", 1, {"train/loss": 3.0})
    writer.close()
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == old
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["train/loss"] == 3.0


# ------------------------------------------------------------------ class 4: a peer's own error, named or not


def test_a_peers_error_is_named_unless_this_rank_raised_the_same(monkeypatch):
    """A rank that ends on an error writes it to the rendezvous store; a peer whose collective then
    fails names it (exit 5). A peer that raised the same error itself (a refused input, seen by every
    rank at its own time) reports its own instead: it must not turn a config error's exit 2 into 5."""
    import torch.distributed as dist

    from harness.distributed import DistInfo
    from harness.reliability.supervisor import PeerMonitor

    store = dist.HashStore()
    monkeypatch.setattr(PeerMonitor, "_connect", lambda self: store)
    info = lambda rank: DistInfo(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    first, late = PeerMonitor(info(1), interval=0.01), PeerMonitor(info(0), interval=0.01)
    first._beat(), late._beat()
    refusal = "ConfigError: the global batch of 64 sequences is larger than the data (12)"
    first.stop(failure=refusal)
    assert late.probe(own=refusal) is None
    verdict = late.probe(own="RuntimeError: gloo: Connection closed by peer")
    assert verdict == f"rank 1 failed ({refusal}; its traceback is in its output)", verdict
