"""`python -m harness.ray` on a real local Ray cluster (2 CPU workers, gloo), under DeepSpeed ZeRO-2:
the run trains exactly as torchrun's 2 ranks do, and a worker that is killed ends the run with one
line, exit 5 and a checkpoint that `checkpoint.resume=auto` continues to the same losses. The
resume runs under torchrun: it is the train command's own resume, which a Ray worker runs
unchanged (`worker_loop`), and a third Ray launch (~40-60 s here) would prove only Ray's start-up
again; a resume under Ray was measured by hand (notes/scaleout.md).

One chain of launches (a Ray launch costs ~30-60 s here: the cluster, its controller and worker
processes start each time). The Ray worker (`harness.scaleout.ray_train.worker_loop`) runs the train
command as a launcher does, with whatever engine the config names, from the rank environment Ray
Train sets; DeepSpeed is the engine that starts its own communication layer on top of it, so it
is the engine run here. FSDP2 under Ray was this chain's engine until 2026-11-28 (notes/scaleout.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import ray.train  # noqa: F401  (in the test extra: a missing Ray fails here, it is never skipped)
from launching import REPO, env, final_eval, launch_command, run, side_by_side, step_losses, tiny_config

from harness.checkpoint import latest_checkpoint
from harness.errors import EXIT_PEER_LOST


def _ray(config: Path, overrides: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: a one-machine cluster on the loopback address only
    e = env() | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"} | extra_env
    cmd = [sys.executable, "-m", "harness.ray", "--config", str(config), "--num-workers", "2", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=400)


def test_ray_trains_as_torchrun_loses_a_worker_in_one_line_and_resumes(tmp_path: Path, data_cache: Path) -> None:
    config = tiny_config(tmp_path / "run.yaml", data_cache, tmp_path / "unused", strategy="zero2")
    ref, out = tmp_path / "torchrun", tmp_path / "ray"
    lost = ["output_dir=" + str(out), "checkpoint.every=2"]
    _, killed = side_by_side(
        lambda: run(launch_command("torchrun", 2, config, [f"output_dir={ref}"])),
        lambda: _ray(config, lost, HARNESS_FAULT="kill@3:1"),  # rank 1 SIGKILLs itself in step 3
    )
    ours = [line for line in killed.stderr.splitlines() if line.startswith("harness.ray:")]
    assert killed.returncode == EXIT_PEER_LOST, killed.stderr[-4000:]
    assert len(ours) == 1 and "rank 1 died without an exit code" in ours[0], ours
    assert ours[0].endswith("resume with checkpoint.resume=auto")
    assert latest_checkpoint(str(out / "checkpoints")).endswith("step_00000002")
    assert step_losses(out) == step_losses(ref)[:2]  # bit-equal: the same ranks, data order and engine

    assert not list(out.glob(".harness-ray-exit-*"))  # the launcher's own exit records are gone
    resumed = run(launch_command("torchrun", 2, config, [*lost, "checkpoint.resume=auto"]))
    assert "resumed from" in resumed.stdout, resumed.stdout[-3000:]
    assert step_losses(out) == pytest.approx(step_losses(ref), rel=1e-6)
    assert final_eval(out) == pytest.approx(final_eval(ref), rel=1e-6)
