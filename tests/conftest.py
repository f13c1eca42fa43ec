"""Shared test setup. Tests live in `unit/` (in-process) and `integration/` (launch real
processes: ranks, launchers, entry points); the latter carry the `integration` marker, so
`pytest -m "not integration"` runs the fast half alone. Shared helpers: `launching.py`.

Session fixtures hold what many tests would otherwise make again: `data_cache`, the one data
cache directory of the session (caches inside are keyed by their data config, so every test
and every launched run that names it shares each prepared cache, and the embedded corpus is
tokenized and its BPE trained once for all of them); `tiny_data`, the cache of `tiny_config`'s
data, prepared once; `tokenizer_dir`, its saved BPE tokenizer, for tests that need a tokenizer
on disk and do not test training one.
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/launching.py
# One thread per process, always: the 2-rank tests share 2 cores, and the bit-exact tests
# compare in-process references with subprocess runs, whose matmul reduction order depends
# on the thread count.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)

INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Integration tests marked; with `HARNESS_TEST_ORDER=reverse` the modules run in reverse order
    (each module's tests in their own order): a test that passes only after, or only before, another
    module's tests in the same worker shows up as a failure in one of the two orders."""
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)
    if os.environ.get("HARNESS_TEST_ORDER") == "reverse":
        modules: dict[str, list[pytest.Item]] = {}
        for item in items:
            modules.setdefault(str(item.fspath), []).append(item)
        items[:] = [item for module in reversed(list(modules.values())) for item in module]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's data cache directory (`data.cache_dir`): pass it to `tiny_config`."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="session")
def tiny_data(data_cache: Path):
    """The prepared cache of `launching.tiny_config`'s data (the embedded corpus, 32-token blocks,
    a 512-token BPE), as `harness.data.PackedData`; runs configured by `tiny_config` with
    `data_cache` find it ready."""
    from launching import TINY_DATA

    from harness.config import DataConfig
    from harness.data import load_packed, prepare_data

    return load_packed(prepare_data("tiny-llama", DataConfig(**TINY_DATA, cache_dir=str(data_cache)), progress=False))


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_data) -> Path:
    """A saved byte-level BPE tokenizer (512 tokens, trained on the embedded corpus): `tiny_data`'s."""
    return Path(tiny_data.tokenizer_dir)


@pytest.fixture(scope="session")
def wandb_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wandb_home")


@pytest.fixture
def isolated_wandb(monkeypatch: pytest.MonkeyPatch, wandb_home: Path) -> None:
    """No API key, no user settings, W&B's caches in a temp dir: the CI situation."""
    for key in list(os.environ):
        if key.startswith("WANDB_") or key.lower() in ("https_proxy", "http_proxy"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("NETRC", str(wandb_home / "netrc-absent"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(wandb_home / var.lower()))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Every test leaves the process's signal handlers and wakeup fd as it found them: a handler left
    installed by one test changes what the next one in the same worker sees (a SIGINT handler that
    records a stop instead of raising KeyboardInterrupt, say). A test that changes them must restore
    them itself; this fails the one that did not, naming the signal, and restores them for the next."""
    import signal

    watched = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    before = {s: signal.getsignal(s) for s in watched}
    yield
    changed = [signal.Signals(s).name for s in watched if signal.getsignal(s) is not before[s]]
    for s in watched:
        signal.signal(s, before[s])
    assert not changed, f"the test left its handler for {', '.join(changed)} installed"
