"""The shipped SLURM script under preemption, with stand-ins for `srun` and `scontrol` (one
node, two CPU ranks under the real torchrun): SIGUSR1 to the batch script makes every worker
save and exit 0, torchrun and the script exit 0, and the job requeues; the requeued job
resumes from the saved step and finishes.

The signal must land mid-run whatever the machine's speed, without a run long enough to be
sure of it: the first job is held in its step-2 checkpoint save (`save_pause`), the test
signals the batch script, and the save goes on only once the script's trap has signalled
the workers (the `srun --overlap` stand-in creates the HARNESS_FAULT_RELEASE file after its
command). So the stop request is seen at step 3, whose checkpoint only the stop writes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from launching import BIN, REPO, env, tiny_config

from harness.checkpoint import latest_checkpoint
from harness.distributed import free_port
from harness.observability.metrics import read_records

SRUN = """#!/usr/bin/env bash
# stand-in for srun on one node: drop srun's own options, run the command in its place
overlap=0
while [ $# -gt 0 ]; do
    case "$1" in
        --overlap) overlap=1; shift ;;
        --nodes|--ntasks-per-node) shift 2 ;;
        --*) shift ;;
        *) break ;;
    esac
done
if [ "$overlap" = 1 ] && [ -n "${HARNESS_FAULT_RELEASE:-}" ]; then
    "$@"  # the preemption trap's step: the workers are signalled when it returns
    status=$?
    touch "$HARNESS_FAULT_RELEASE"  # the run held in its save may go on
    exit "$status"
fi
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
case "$1" in
    show) echo localhost ;;
    requeue) echo "requeue $2" >> "$REQUEUE_LOG" ;;
esac
"""


def _slurm_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    e = env()
    e.update(
        PATH=f"{bin_dir}{os.pathsep}{BIN}{os.pathsep}{e['PATH']}",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_ID="4242",
        SLURM_NNODES="1",
        SLURM_GPUS_ON_NODE="2",
        MASTER_PORT=str(free_port()),
        REQUEUE_LOG=str(tmp_path / "requeue.log"),
    )
    return e


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [r["step"] for r in read_records(str(path)) if "train/loss" in r] if path.exists() else []


def test_preemption_saves_exits_zero_everywhere_and_requeues(tmp_path, data_cache):
    out = tmp_path / "run"
    cfg = tiny_config(tmp_path / "run.yaml", data_cache, out, steps=8, **{"checkpoint.every": 2})
    script = str(REPO / "launch" / "slurm_multinode.sbatch")
    held = _slurm_env(tmp_path) | {"HARNESS_FAULT": "save_pause=120@2", "HARNESS_FAULT_RELEASE": str(tmp_path / "signalled")}
    job = subprocess.Popen(["bash", script, str(cfg)], cwd=REPO, env=held, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / ".tmp-step_00000002" / "meta.json").exists() and time.monotonic() < deadline:  # held
            assert job.poll() is None, job.communicate()[0][-3000:]
            time.sleep(0.2)
        assert _steps(out) == [1, 2]
        os.kill(job.pid, signal.SIGUSR1)  # SLURM's --signal=B:USR1@90
        log = job.communicate(timeout=300)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, log[-4000:]
    assert (tmp_path / "requeue.log").read_text().split() == ["requeue", "4242"]
    assert "stop requested (SIGTERM/SIGUSR1/Ctrl-C): saved" in log and "Traceback" not in log, log[-4000:]
    saved = latest_checkpoint(str(out / "checkpoints"))
    assert saved is not None and int(saved[-8:]) == 3  # the step after the held save: written by the stop, not by `every`
    assert _steps(out) == [1, 2, 3]
    again = subprocess.run(["bash", script, str(cfg)], cwd=REPO, env=_slurm_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resumed from {saved}" in again.stdout and _steps(out)[-1] == 8
    assert (tmp_path / "requeue.log").read_text().split() == ["requeue", "4242"]  # a finished job is not requeued
