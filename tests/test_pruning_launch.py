"""Multi-process launcher shared by the pruning tests (gloo on CPU, one thread per rank).

Each rank is a fresh `python <script> <args>` with the torchrun environment variables, so
the code under test initialises its process group exactly as under a real launcher.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, args: list[str], world: int, timeout: float = 240.0) -> list[str]:
    """Run `world` ranks of `script`; returns each rank's combined output; fails on any error."""
    procs, _ = start(script, args, world)
    return finish(procs, f"{os.path.basename(script)} {args}", timeout)


def start(script: str, args: list[str], world: int) -> tuple[list[subprocess.Popen], int]:
    """Like `launch` but returns immediately, so two worlds can run side by side."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
            PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        )
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs, port


def finish(procs: list[subprocess.Popen], what: str, timeout: float = 240.0) -> list[str]:
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            pytest.fail(f"rank {rank} of {what} failed ({p.returncode}):\n{out[-6000:]}")
    return outputs
