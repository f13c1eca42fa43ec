"""Launching past one machine, what needs no cluster: the SLURM script generator (the shipped
script is its output; checks before anything is written), the Ray launcher's refusals before any
worker starts, and how it turns what its workers left into one exit code and one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from launching import REPO, call_entry_point, env

from harness import ray as ray_command
from harness import slurm as slurm_command
from harness.errors import EXIT_BAD_INPUT, EXIT_CHECKPOINT, EXIT_OK, EXIT_PEER_LOST, EXIT_PLAN_DOES_NOT_FIT
from harness.scaleout import SlurmJob, WorkerExit, outcome, render_sbatch

SHIPPED = REPO / "launch" / "slurm_multinode.sbatch"


def _config(tmp_path: Path, **extra) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "tiny-llama"}, "steps": 3, "output_dir": str(tmp_path / "out"), **extra}))
    return path


def test_the_shipped_slurm_script_is_the_generator_output_for_its_defaults() -> None:
    assert render_sbatch(SlurmJob()) == SHIPPED.read_text()


def test_a_generated_script_carries_the_job_and_its_config(tmp_path: Path) -> None:
    job = SlurmJob(
        nodes=4, gpus_per_node=2, time="2-00:00:00", signal_lead=300, partition="gpu", account="proj", train_args=["/x/run.yaml", "steps=9"]
    )
    text = render_sbatch(job)
    for line in (
        "--nodes=4",
        "--gpus-per-node=2",
        "--time=2-00:00:00",
        "--signal=B:USR1@300",
        "--partition=gpu",
        "--account=proj",
        "--requeue",
    ):
        assert f"#SBATCH {line}\n" in text
    assert "[ $# -gt 0 ] || set -- /x/run.yaml steps=9" in text
    assert "gpus_per_node=${SLURM_GPUS_ON_NODE:-2}" in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0  # bash parses it


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--nodes", "0", "--gpus-per-node", "8"], "--nodes 0: give at least 1"),
        (["--nodes", "2", "--gpus-per-node", "8", "--time", "tomorrow"], "is not a SLURM time limit"),
        (["--nodes", "2", "--gpus-per-node", "8", "--signal-lead", "2"], "--signal-lead 2"),
        (["--nodes", "2", "--gpus-per-node", "8", "global_batch_size=4"], "global_batch_size"),  # right for 1 rank, not 16
        (["--nodes", "2", "--gpus-per-node", "8", "optim.lrr=1"], "optim.lr"),
    ],
)
def test_slurm_refuses_in_one_line_and_writes_nothing(argv, says, tmp_path, monkeypatch, capfd) -> None:
    out = tmp_path / "job.sbatch"
    code, err, _ = call_entry_point(slurm_command.main, [str(_config(tmp_path)), *argv, "--out", str(out)], env(), monkeypatch, capfd)
    assert code == EXIT_BAD_INPUT
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_slurm_never_overwrites_and_dry_run_writes_nothing(tmp_path, monkeypatch, capfd) -> None:
    cfg = str(_config(tmp_path))
    out = tmp_path / "job.sbatch"
    out.write_text("the user's own script\n")
    code, err, _ = call_entry_point(
        slurm_command.main, [cfg, "--nodes", "1", "--gpus-per-node", "2", "--out", str(out)], env(), monkeypatch, capfd
    )
    assert code == EXIT_BAD_INPUT and "never overwrites" in err
    assert out.read_text() == "the user's own script\n"
    fresh = tmp_path / "new.sbatch"
    code, err, _ = call_entry_point(
        slurm_command.main, [cfg, "--nodes", "1", "--gpus-per-node", "2", "--out", str(fresh), "--dry-run"], env(), monkeypatch, capfd
    )
    assert code == EXIT_OK and not fresh.exists()
    assert "memory not checked" in err
    code, _, _ = call_entry_point(
        slurm_command.main, [cfg, "--nodes", "1", "--gpus-per-node", "2", "--out", str(fresh)], env(), monkeypatch, capfd
    )
    assert code == EXIT_OK and fresh.read_text() == render_sbatch(
        SlurmJob(nodes=1, gpus_per_node=2, name="new.sbatch", path=str(fresh), train_args=[cfg])
    )


def test_slurm_asks_the_planner_for_the_whole_world_and_stops_when_it_does_not_fit(tmp_path, monkeypatch, capfd) -> None:
    asked = []

    def planner(cmd, **kwargs):
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, EXIT_PLAN_DOES_NOT_FIT)

    monkeypatch.setattr(slurm_command.subprocess, "run", planner)
    out = tmp_path / "job.sbatch"
    argv = [str(_config(tmp_path)), "--nodes", "3", "--gpus-per-node", "4", "--gpu-mem", "24GiB", "--out", str(out), "precision=bf16"]
    code, err, _ = call_entry_point(slurm_command.main, argv, env(), monkeypatch, capfd)
    assert code == EXIT_PLAN_DOES_NOT_FIT and "does not fit" in err and not out.exists()
    (cmd,) = asked
    assert cmd[1:3] == ["-m", "harness.plan"]
    assert cmd[cmd.index("--gpus") + 1] == "12" and cmd[cmd.index("--gpus-per-node") + 1] == "4" and cmd[-1] == "precision=bf16"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--num-workers", "0"], "--num-workers 0: give at least 1 worker"),
        (["--num-workers", "2", "--cpus-per-worker", "0"], "--cpus-per-worker 0"),
        (["--num-workers", "2", "micro_batch_sise=2"], "micro_batch_size"),
        (["--num-workers", "3", "global_batch_size=4"], "global_batch_size"),  # right for the driver alone, not 3 workers
    ],
)
def test_ray_refuses_before_any_worker_starts(argv, says, tmp_path, monkeypatch, capfd) -> None:
    monkeypatch.setattr(ray_command, "launch_ray", lambda req: pytest.fail("a worker would have started"))
    code, err, _ = call_entry_point(ray_command.main, ["--config", str(_config(tmp_path)), *argv], env(), monkeypatch, capfd)
    assert code == EXIT_BAD_INPUT
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_ray_outcome_one_code_one_line() -> None:
    assert outcome(2, {0: EXIT_OK, 1: EXIT_OK}, {}) == (EXIT_OK, "")
    code, line = outcome(2, {}, {1: RuntimeError("actor died")})  # killed: no record, no WorkerExit
    assert code == EXIT_PEER_LOST and line.startswith("rank 1 died without an exit code")
    code, line = outcome(2, {0: EXIT_PEER_LOST}, {1: RuntimeError("actor died")})  # the survivor saw its peer go
    assert code == EXIT_PEER_LOST and "rank 0 exited with code 5" in line and "rank 1 died" in line
    code, line = outcome(2, {}, {0: WorkerExit(EXIT_CHECKPOINT, 0), 1: WorkerExit(EXIT_CHECKPOINT, 1)})
    assert (code, line) == (EXIT_CHECKPOINT, "rank 0 exited with code 6 (its error is printed above)")
