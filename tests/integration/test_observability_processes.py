"""Observability across processes: rank 0 alone writes (two real ranks), and a W&B server that
never answers makes the run fall back to offline instead of hanging it."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from launching import REPO

from harness.config import LoggingConfig
from harness.observability import Observer

pytestmark = pytest.mark.usefixtures("isolated_wandb")
ROOT = str(REPO)


def test_online_init_that_hangs_falls_back_to_offline(tmp_path):
    """A server that accepts and never answers: init times out, the run goes on offline."""
    script = textwrap.dedent(
        f"""
        import os, socket, sys, threading
        srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(64)
        held = []
        threading.Thread(target=lambda: [held.append(srv.accept()) for _ in iter(int, 1)], daemon=True).start()
        os.environ.update(WANDB_BASE_URL=f"http://127.0.0.1:{{srv.getsockname()[1]}}", WANDB_API_KEY="k" * 40,
                          WANDB_INIT_TIMEOUT="2", WANDB_LOGIN_TIMEOUT="2")
        from harness.config import LoggingConfig
        from harness.observability import Observer
        obs = Observer({str(tmp_path / "run")!r}, {{}}, LoggingConfig(progress=False, plots=False), 0, 1, 1)
        obs.log_step(1, {{"loss": 3.0}})
        print("MODE", obs.close()["wandb_mode"])
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = ROOT
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        mode_line = next((line for line in proc.stdout if line.startswith("MODE")), "")
        elapsed = time.monotonic() - start
    finally:
        # The abandoned online attempt keeps wandb's service busy for ~20 s after the run
        # is done (it only delays interpreter exit); the test does not wait for that.
        proc.kill()
        stderr = proc.communicate(timeout=60)[1]
    assert mode_line.strip() == "MODE offline", stderr[-2000:]
    assert "init failed online" in stderr
    assert elapsed < 90.0
    assert glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))


def _rank_worker(rank: int, base: str, init_file: str) -> None:
    import torch.distributed as dist

    with open(os.path.join(base, f"stdout{rank}.txt"), "w") as out, open(os.path.join(base, f"stderr{rank}.txt"), "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        try:
            run_dir = os.path.join(base, f"run_rank{rank}")
            obs = Observer(run_dir, {"precision": "fp32"}, LoggingConfig(progress=True), dist.get_rank(), 2, 2)
            for step in (1, 2):
                loss = torch.tensor(float(step))
                dist.all_reduce(loss)
                obs.log_step(step, {"loss": loss, "perf/tokens_per_s": 100.0 * step})
            obs.log_eval(2, {"loss": 1.0})
            obs.log_prune({"achieved_sparsity": 0.5})
            summary = obs.close()
            if rank != 0:
                assert summary == {} and "wandb" not in sys.modules and "matplotlib" not in sys.modules
        finally:
            dist.destroy_process_group()


def test_only_rank_zero_writes_two_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_worker, args=(str(tmp_path), str(tmp_path / "pg_init")), nprocs=2, join=True)
    assert not (tmp_path / "run_rank1").exists()
    assert (tmp_path / "stdout1.txt").read_text() == ""
    stderr1 = (tmp_path / "stderr1.txt").read_text()
    assert "harness" not in stderr1 and "wandb" not in stderr1
    rank0 = tmp_path / "run_rank0"
    assert (rank0 / "metrics.jsonl").is_file() and (rank0 / "loss.png").is_file()
    assert len(glob.glob(str(rank0 / "wandb" / "offline-run-*"))) == 1
    console0 = (tmp_path / "stdout0.txt").read_text()
    assert "step 2/2" in console0 and "Run summary" in console0
