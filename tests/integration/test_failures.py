"""Failure handling through the user's entry points: preemption, non-finite steps, OOM, dead and hung ranks.

Faults are real where they can be on CPU: SIGTERM to torchrun, SIGKILL/SIGSTOP of a rank.
Where they cannot (a NaN on a chosen step and rank, a GPU OOM, a signal reaching only one
rank at a chosen step), `HARNESS_FAULT` injects the real thing at a real point of the run
(`harness/faults.py`, `harness/reliability/faults.py`): a NaN in the LM head's output, a `torch.OutOfMemoryError` raised
in forward, a SIGUSR1 the process sends itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from launching import REPO, env, free_port, launch_command, tiny_config

from harness.checkpoint import consolidated_weights, latest_checkpoint
from harness.observability.metrics import read_records

DEAD_RANK_BOUND_S = 60  # the bound: the others exit within this after a rank dies


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    e = env()
    e.update(extra or {})
    return e


def _run(cmd: list[str], extra_env: dict[str, str] | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(extra_env), capture_output=True, text=True, timeout=300)
    if ok and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def records(out: Path) -> list[dict]:
    return read_records(str(out / "metrics.jsonl"))


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in records(out) if "train/loss" in r}


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count('"train/loss"') if path.exists() else 0


def wait_for_steps(out: Path, n: int, procs: list[subprocess.Popen], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while logged_steps(out) < n:
        assert all(p.poll() is None for p in procs), "the run ended before the fault was injected"
        assert time.monotonic() < deadline, "the run did not reach the step"
        time.sleep(0.05)


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of a torchrun worker by its RANK (read from /proc: no psutil needed)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


def weights(step_dir: Path) -> dict[str, torch.Tensor]:
    return consolidated_weights(str(step_dir))[0]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def ws(tmp_path_factory, data_cache):
    return {"root": tmp_path_factory.mktemp("failures"), "cache": data_cache}


def config(ws, name: str, **extra) -> tuple[Path, Path]:
    out = ws["root"] / name
    return tiny_config(ws["root"] / f"{name}.yaml", ws["cache"], out, **extra), out


# ------------------------------------------------------------------ preemption


def test_sigterm_to_torchrun_saves_exits_cleanly_and_resume_is_bit_exact(ws):
    """SLURM's path: SIGTERM reaches torchrun, which relays it; the ranks agree, save and exit 0."""
    steps = 80
    ref_cfg, ref_out = config(ws, "ddp_ref", steps=steps)
    _run(launch_command("torchrun", 2, ref_cfg, ["strategy=ddp"]))
    cfg, out = config(ws, "ddp_preempted", steps=steps)
    cmd = launch_command("torchrun", 2, cfg, ["strategy=ddp"])
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_steps(out, 3, [proc])
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert "stop requested (SIGTERM/SIGUSR1/Ctrl-C): saved" in log, log[-3000:]
    for rank in (0, 1):  # every worker exited 0 (torchrun itself reports the signal it got)
        assert f"rank      : {rank}" not in log, log[-3000:]
    saved = latest_checkpoint(str(out / "checkpoints"))
    k = int(Path(saved).name.split("_")[1])
    assert 3 <= k < steps and max(losses(out)) == k

    resumed = _run(cmd + ["checkpoint.resume=auto"])
    assert f"resumed from {saved} at step {k}" in resumed.stdout
    ref, got = losses(ref_out), losses(out)
    assert [got[s] for s in range(k + 1, steps + 1)] == [ref[s] for s in range(k + 1, steps + 1)]  # bit-exact, DDP


PRUNING_STARTED = "prune: decision=original filled"  # the stage's first line, before its first probe pass


def sigterm_once_logged(cmd: list[str], log_path: Path, line: str) -> tuple[int, float, str]:
    """Start `cmd`, SIGTERM it once its output holds `line`; (exit code, seconds from the signal to
    the exit, the output)."""
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log_file, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 180
        while line not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = proc.wait(timeout=120)
    return code, time.monotonic() - signalled, log_path.read_text()


def test_sigterm_while_pruning_stops_within_a_step_and_resume_prunes_the_same(ws):
    """A long prune (GradProbe's original mode, 28 passes) after 3 trained steps, checkpoints every
    2: the trained model is saved at step 3 before pruning starts; SIGTERM to torchrun while it
    prunes ends both ranks at the same calibration step, exit 0, with a line saying where a
    relaunch starts; the relaunch resumes at step 3 and prunes exactly as an unstopped run."""
    prune = {
        "prune.method": "gradprobe",
        "prune.decision": "original",
        "prune.calib_samples": 64,
        "prune.finetune_steps": 1,
        "data.calib_fraction": 0.4,
        "checkpoint.every": 2,
    }
    ref_cfg, ref_out = config(ws, "prune_ref", **prune)
    _run(launch_command("torchrun", 2, ref_cfg, ["strategy=ddp"]))
    cfg, out = config(ws, "prune_stopped", **prune)
    cmd = launch_command("torchrun", 2, cfg, ["strategy=ddp"])
    _, waited, log = sigterm_once_logged(cmd, ws["root"] / "prune_stopped.log", PRUNING_STARTED)
    step3 = out / "checkpoints" / "step_00000003"
    assert "stop requested while pruning, after" in log and f"{step3} holds the model as training left it" in log, log[-3000:]
    assert "pruned gradprobe" not in log and waited < 60, (waited, log[-3000:])
    for rank in (0, 1):  # every worker exited 0 (torchrun itself reports the signal it got)
        assert f"rank      : {rank}" not in log, log[-3000:]
    assert latest_checkpoint(str(out / "checkpoints")) == str(step3)
    assert not [r for r in records(out) if "prune/achieved_sparsity" in r]

    resumed = _run(cmd + ["checkpoint.resume=auto"])
    assert f"resumed from {step3} at step 3" in resumed.stdout, resumed.stdout[-3000:]
    final, ref_final = out / "checkpoints" / "step_00000004", ref_out / "checkpoints" / "step_00000004"
    assert same_weights(final, ref_final)  # the same masks and the same fine-tuning step
    assert same_weights(step3, ref_out / "checkpoints" / "step_00000003")  # the reference saved the trained model too


def test_sigterm_while_the_prune_command_prunes_exits_0_and_says_how_to_relaunch(ws):
    """`python -m harness.prune` on a saved model: SIGTERM mid-prune ends it at the next
    calibration step, exit 0, one line naming the relaunch (which, as named, prunes and exports)."""
    dense_cfg, dense = config(ws, "prune_cmd_dense", steps=2, **{"checkpoint.export_hf": True})
    _run(launch_command("python", 1, dense_cfg, []))
    prune = {"prune.method": "gradprobe", "prune.decision": "original", "prune.calib_samples": 64, "data.calib_fraction": 0.4}
    cfg, out = config(ws, "prune_cmd", **{"model.name": str(dense / "hf"), **prune})
    cmd = [sys.executable, "-m", "harness.prune", "--config", str(cfg)]
    code, _, log = sigterm_once_logged(cmd, ws["root"] / "prune_cmd.log", PRUNING_STARTED)
    assert code == 0, log[-3000:]
    assert "nothing of it was saved: a relaunch prunes again from the start, with checkpoint.overwrite=true" in log, log[-3000:]
    assert "pruned gradprobe" not in log and not (out / "hf").exists()
    again = _run(cmd + ["checkpoint.overwrite=true"])
    assert "pruned model exported to" in again.stdout, again.stdout[-3000:]


def test_signal_on_one_rank_and_nan_on_one_rank_under_zero2(ws):
    """Rank 1 alone gets a NaN at step 2 and a SIGUSR1 at step 3: both ranks skip step 2, both save step 3 and exit."""
    cfg, out = config(ws, "zero2_faults", steps=6, **{"checkpoint.every": 1, "checkpoint.keep": 6})
    proc = _run(launch_command("torchrun", 2, cfg, ["strategy=zero2"]), {"HARNESS_FAULT": "nan_loss@2:1,signal@3:1"})
    assert "step 2: non-finite loss; update skipped (1 so far" in proc.stderr  # a warning: stderr
    assert "stop requested (SIGTERM/SIGUSR1/Ctrl-C): saved" in proc.stdout
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == [f"step_0000000{i}" for i in (1, 2, 3)]
    assert latest_checkpoint(str(ckpts)).endswith("step_00000003")
    rows = {r["step"]: r for r in records(out) if "train/loss" in r}
    assert sorted(rows) == [1, 2, 3] and rows[2]["train/skipped_steps"] == 1 and rows[3]["train/skipped_steps"] == 1
    assert same_weights(ckpts / "step_00000001", ckpts / "step_00000002"), "the NaN step changed the weights"
    assert not same_weights(ckpts / "step_00000002", ckpts / "step_00000003")


# ------------------------------------------------------------------ one-process faults, side by side


@pytest.fixture(scope="module")
def one_process(ws, tiny_data) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The three one-process fault runs (a NaN stop, a NaN under DeepSpeed ZeRO-0, an OOM), two at a
    time (each uses one of the CI machine's two cores; see `launching.side_by_side`), started by the
    first test that needs one (the data cache ready first: `tiny_data`, so neither waits on the
    other's preparation); name -> (process, output directory). Each was its own test's launch,
    one after another; their assertions are unchanged."""
    import json

    zero0 = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    zero0["zero_optimization"]["stage"] = 0
    (ws["root"] / "zero0.json").write_text(json.dumps(zero0))
    runs = {
        "nan_stop": (
            config(ws, "nan_stop", steps=6, **{"checkpoint.every": 1, "checkpoint.keep": 6, "checkpoint.on_nonfinite": "stop"}),
            [],
            "nan_loss@3",
        ),
        "oom": (config(ws, "oom", steps=4, **{"memory.track": True}), [], "oom@3"),
        "zero0_nan": (
            config(ws, "zero0_nan", steps=3, **{"checkpoint.every": 1, "checkpoint.keep": 3}),
            [f"strategy={ws['root'] / 'zero0.json'}"],
            "nan_loss@2",
        ),
    }

    # rank 1 alone raises in step 3 while rank 0 waits in that step's all-reduce (the collective timeout
    # raised to the test's own, so only leaving without a barrier ends the run in time)
    runs["bug_on_one_rank"] = (config(ws, "bug_on_one_rank", steps=4), ["strategy=ddp"], "error@3:1")

    def job(name: str):
        (cfg, out), overrides, fault = runs[name]
        world, timeout = (2, {"HARNESS_COLLECTIVE_TIMEOUT_S": "1000"}) if name == "bug_on_one_rank" else (1, {})
        started = time.monotonic()
        launcher = "torchrun" if world > 1 else "python"
        proc = _run(launch_command(launcher, world, cfg, overrides), {"HARNESS_FAULT": fault, **timeout}, ok=False)
        proc.wall_s = time.monotonic() - started  # type: ignore[attr-defined]
        return proc, out

    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(job, name) for name in runs}
        return {name: f.result() for name, f in futures.items()}


# ------------------------------------------------------------------ non-finite steps


def test_nan_stop_names_the_step_and_the_last_good_checkpoint(one_process):
    proc, out = one_process["nan_stop"]
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("harness: error:")]
    last_good = out / "checkpoints" / "step_00000002"
    assert len(errors) == 1 and "non-finite loss at step 3" in errors[0] and str(last_good) in errors[0], proc.stderr[-3000:]
    assert latest_checkpoint(str(out / "checkpoints")) == str(last_good)
    assert not (out / "checkpoints" / "step_00000003").exists()


def test_a_save_that_cannot_be_written_ends_in_one_line_exit_6_and_resumes(ws):
    """Rank 1's disk fills up in step 4's save (ENOSPC, injected): both ranks exit 6, rank 0
    names rank 1's reason in one line, the partial save is removed, `latest` still names
    step 2, and once there is space again the run resumes from step 2 and finishes."""
    cfg, out = config(ws, "disk_full", steps=4, **{"checkpoint.every": 2})
    proc = _run(launch_command("torchrun", 2, cfg, []), {"HARNESS_FAULT": "save_error@4:1"}, ok=False)
    assert proc.returncode != 0 and proc.stderr.count("(exitcode: 6)") >= 1, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("harness: error:")]
    assert len(errors) == 1 and "could not write the checkpoint of step 4 (rank 1: OSError: [Errno 28] No space left" in errors[0]
    assert f'File "{REPO / "harness"}' not in proc.stderr  # no traceback through harness (torchrun prints its own)
    ckpts = out / "checkpoints"
    assert latest_checkpoint(str(ckpts)) == str(ckpts / "step_00000002")
    assert not list(ckpts.glob(".tmp-*")) and not (ckpts / "step_00000004").exists()
    resumed = _run(launch_command("torchrun", 2, cfg, ["checkpoint.resume=auto"]))
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in resumed.stdout
    assert latest_checkpoint(str(ckpts)) == str(ckpts / "step_00000004")


def test_deepspeed_without_zero_does_not_apply_a_nan_step(one_process):
    """Stage 0 in fp32 hands DeepSpeed a bare torch optimizer with no overflow check of its own."""
    proc, out = one_process["zero0_nan"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2: non-finite loss; update skipped" in proc.stderr
    ckpts = out / "checkpoints"
    assert same_weights(ckpts / "step_00000001", ckpts / "step_00000002")
    assert all(torch.isfinite(t).all() for t in weights(ckpts / "step_00000003").values())
    assert losses(out)[3] == losses(out)[3]  # finite again after the skipped step (NaN != NaN)


# ------------------------------------------------------------------ out of memory


def test_oom_prints_memory_by_category_and_the_planner_change(one_process):
    proc, out = one_process["oom"]
    assert proc.returncode == 4, proc.stderr[-3000:]
    err = proc.stderr
    assert "harness: error: out of memory on rank 0 (cpu) in step 3" in err
    assert "held now by category: params" in err and "optim_state" in err
    assert "peak of the largest measured step" in err and "activations" in err
    assert "the planner would change: memory.activation_checkpointing=full (estimated peak" in err, err[-3000:]
    assert "Traceback" not in err
    assert max(losses(out)) == 2


def test_a_bug_on_one_rank_ends_every_rank_without_waiting_for_the_collective_timeout(one_process):
    """The failing rank leaves without the teardown barrier its peer could never join (it waits in
    the step's all-reduce), and says so in the rendezvous store: the peer's collective fails on the
    closed connection and it names rank 1's error in one line (exit 5). Before, both waited out the
    collective timeout (600 s by default) and the peer printed gloo's traceback."""
    proc, out = one_process["bug_on_one_rank"]
    assert proc.returncode != 0 and "injected by HARNESS_FAULT=error@3" in proc.stderr, proc.stderr[-3000:]
    assert "harness: error: rank 0: rank 1 failed (RuntimeError: injected by HARNESS_FAULT=error@3" in proc.stderr, proc.stderr[-3000:]
    assert proc.wall_s < 240, proc.wall_s  # the subprocess's own bound is 300 s; the timeout would be 1,000
    assert max(losses(out)) == 2


# ------------------------------------------------------------------ dead and hung ranks


def _env_launch(cfg: Path, port: int, extra: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Two ranks started the way srun starts tasks: environment variables, no agent watching them."""
    procs = []
    for rank in (0, 1):
        e = _env(
            {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **(extra or {}),
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "harness.train", "--config", str(cfg)],
                cwd=REPO,
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def test_killed_rank_under_torchrun_others_exit_naming_it(ws):
    cfg, out = config(ws, "killed_rank", steps=100000)
    launcher = subprocess.Popen(
        launch_command("torchrun", 2, cfg, ["strategy=ddp"]),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_steps(out, 3, [launcher])
    os.kill(rank_pid(launcher.pid, 1), signal.SIGKILL)
    t0 = time.monotonic()
    log = launcher.communicate(timeout=DEAD_RANK_BOUND_S + 30)[0]
    assert time.monotonic() - t0 < DEAD_RANK_BOUND_S
    assert launcher.returncode != 0
    assert "harness: error: rank 0: rank 1 died" in log, log[-3000:]


def test_hung_rank_without_an_agent_is_named_within_60s(ws):
    """SIGSTOP: rank 1 is alive but frozen (its sockets stay open, so no collective fails); the heartbeat notices."""
    cfg, out = config(ws, "hung_rank", steps=100000)
    procs = _env_launch(cfg, free_port(), {"HARNESS_PEER_TIMEOUT_S": "10"})  # default 30 s; shorter keeps the suite fast
    try:
        wait_for_steps(out, 3, procs)
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=DEAD_RANK_BOUND_S + 30)
        assert time.monotonic() - t0 < DEAD_RANK_BOUND_S
        assert procs[0].returncode == 5 and "rank 1 died or hangs (no heartbeat for" in err, err[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_killed_store_host_rank_is_named(ws):
    """Without torchrun, rank 0 hosts the rendezvous store: losing it is named as losing rank 0."""
    cfg, out = config(ws, "killed_rank0", steps=100000)
    procs = _env_launch(cfg, free_port())
    try:
        wait_for_steps(out, 3, procs)
        procs[0].kill()
        t0 = time.monotonic()
        _, err = procs[1].communicate(timeout=DEAD_RANK_BOUND_S + 30)
        assert time.monotonic() - t0 < DEAD_RANK_BOUND_S
        assert procs[1].returncode == 5 and "hosted by rank 0: rank 0 died" in err, err[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.communicate()
