"""Fault injection's pause (`save_pause`): a fixed length, or until the test releases it."""

from __future__ import annotations

import threading
import time

from harness.faults import fault_seconds, hold


def test_save_pause_is_parsed_per_step(monkeypatch):
    monkeypatch.setenv("HARNESS_FAULT", "save_pause=2.5@4")
    assert fault_seconds("save_pause", 4) == 2.5 and fault_seconds("save_pause", 3) == 0.0


def test_a_pause_lasts_its_length_without_a_release_file(monkeypatch):
    monkeypatch.delenv("HARNESS_FAULT_RELEASE", raising=False)
    t0 = time.monotonic()
    hold(0.3)
    assert time.monotonic() - t0 >= 0.3


def test_a_pause_ends_once_the_release_file_exists(tmp_path, monkeypatch):
    release = tmp_path / "release"
    monkeypatch.setenv("HARNESS_FAULT_RELEASE", str(release))
    t0 = time.monotonic()
    timer = threading.Timer(0.3, release.touch)
    timer.start()
    hold(60)
    held = time.monotonic() - t0
    timer.join()
    assert 0.3 <= held < 10, held
