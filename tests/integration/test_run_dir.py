"""One run directory, one owner, through the user's entry points: a directory whose run died
is taken over; a second run on a live directory is refused in one line naming the owner, on
every rank, and nothing of the first run is touched. One held run shows both: it starts on
the directory of a run that died."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from launching import REPO, env, launch_command, run, tiny_config

from harness.observability.metrics import read_records


def _train_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_records(str(out / "metrics.jsonl")) if "train/loss" in r]


def _dead_run_lock(out: Path) -> int:
    """A lock left in `out` by a run that died (a pid that no longer exists, on this host); its pid."""
    out.mkdir()
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    (out / ".harness-run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid, "started": 1.0}))
    return dead_pid


def test_a_live_run_directory_is_refused_and_left_alone(tmp_path, data_cache):
    """The first run takes over the directory of a run that died (this was its own test, with a
    run of its own), then is held alive by an injected pause in its step-1 checkpoint save.

    The pause must outlast both refused launches (two fresh interpreters importing torch, then
    torchrun with two ranks: ~15 s idle, more on a loaded 2-core machine), and a fixed length
    is either wasted or, under load, too short. So it ends when the test is done with it: the
    test creates the HARNESS_FAULT_RELEASE file (outside the run directory, whose listing is
    compared) after its last check that the first run is still in its save; 300 s is only the
    cap should the test die before that."""
    out = tmp_path / "run"
    dead_pid = _dead_run_lock(out)
    release = tmp_path / "release-the-save"
    cfg = tiny_config(tmp_path / "a.yaml", data_cache, out, steps=4, **{"checkpoint.every": 1})
    held = env() | {"HARNESS_FAULT": "save_pause=300@1", "HARNESS_FAULT_RELEASE": str(release)}
    first = subprocess.Popen(
        launch_command("python", 1, cfg, []), cwd=REPO, env=held, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob("checkpoints/.tmp-step_00000001/meta.json")) and time.monotonic() < deadline:  # the pause begins
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        lock = json.loads((out / ".harness-run.lock").read_text())
        assert lock["pid"] == first.pid
        before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
        second = run(launch_command("python", 1, cfg, []), timeout=300, check=False)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = [ln for ln in second.stderr.splitlines() if "error" in ln]
        assert len(lines) == 1 and "is in use by another run" in lines[0] and f"pid {first.pid} on host" in lines[0]
        assert "Traceback" not in second.stderr
        # torchrun stops the other ranks (SIGTERM) as soon as one exits, so it reports the first: rank 0's 2
        two_ranks = run(launch_command("torchrun", 2, cfg, []), timeout=300, check=False)
        assert two_ranks.returncode != 0 and "(exitcode: 2)" in two_ranks.stderr, two_ranks.stderr[-3000:]
        assert "is in use by another run" in two_ranks.stderr
        assert first.poll() is None, "the first run must still be in its save"
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing of the first run touched
        release.touch()
        stdout, stderr = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr[-2000:]
    assert f"the run that held it (pid {dead_pid} on host" in stderr and "is gone; taking it over" in stderr  # the dead run's
    assert _train_steps(out) == [1, 2, 3, 4]  # no step logged twice, none by another run
    assert not (out / ".harness-run.lock").exists()
