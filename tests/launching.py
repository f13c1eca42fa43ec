"""The one place for what tests need to launch real processes.

Two kinds of launch: the user's entry points under a real launcher (`launch_command`,
`run`), and a test file run as `world` ranks of its own (`launch`, `start`, `finish`),
each rank a fresh `python <script>` with the torchrun environment variables, so the code
under test initialises its process group exactly as under a real launcher. And, for input
an entry point must refuse before any process group starts, its `main` called in the test's
own interpreter (`call_entry_point`): no fresh interpreter importing torch for each case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest
import yaml

from harness.distributed import exit_process, free_port

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
BIN = Path(sys.executable).parent
TRAIN = str(REPO / "harness" / "train.py")


# The data of `tiny_config` (the embedded corpus); conftest's `tiny_data` is its prepared cache.
TINY_DATA = {"seq_len": 32, "max_tokens": 20000, "vocab_size": 512}


def tiny_config(path: Path, cache: Path, output: Path, **extra) -> Path:
    """A run config small enough for 2 CPU ranks on 2 cores: tiny Llama, 32-token blocks.
    `cache`: the data cache directory, normally the session's (conftest's `data_cache`), so the
    corpus is tokenized once for the whole suite."""
    cfg = {
        "model": {"name": "tiny-llama"},
        "data": {**TINY_DATA, "cache_dir": str(cache)},
        "micro_batch_size": 2,
        "grad_accum": 2,
        "steps": 3,
        "eval_batches": 2,
        "optim": {"lr": 0.01, "warmup_steps": 1},
        "logging": {"wandb": False, "progress": False, "plots": False},
        "memory": {"track": False},
        "output_dir": str(output),
    }
    for key, value in extra.items():
        node = cfg
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


INSTRUCTION_WORDS = "apple river stone cloud maple tiger ocean pencil garden silver planet candle".split()


def instruction_file(path: Path, n: int, seed: int = 0) -> Path:
    """`n` instruction records (JSON lines): two thirds prompt/response ("reverse the list"),
    one third chat messages ("sort"), answers learnable from the prompt."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            w = rng.sample(INSTRUCTION_WORDS, 3)
            if i % 3 == 0:
                rec: dict = {
                    "messages": [{"role": "user", "content": "Sort: " + " ".join(w)}, {"role": "assistant", "content": " ".join(sorted(w))}]
                }
            else:
                rec = {"prompt": f"Reverse the list {' '.join(w)}\nAnswer:", "response": " " + " ".join(reversed(w))}
            f.write(json.dumps(rec) + "\n")
    return path


def tied_llama(path: Path) -> Path:
    """The check's tiny Llama saved at `path`: tied embeddings, a 515-row vocabulary (uneven over 2 ranks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=515, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), e.get("PYTHONPATH", "")])
    for key in list(e):  # a test must not inherit a launcher's identity
        if key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or key.startswith(("ACCELERATE_", "FSDP_")):
            del e[key]
    return e


def launch_command(launcher: str, nproc: int, config: Path, overrides: list[str]) -> list[str]:
    port = str(free_port())
    if launcher == "python":
        return [sys.executable, "-m", "harness.train", "--config", str(config), *overrides]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", f"--master_port={port}", TRAIN, "--config", str(config), *overrides]
    if launcher == "accelerate":
        return [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(REPO / "launch" / "accelerate_cpu.yaml"),
            "--num_processes",
            str(nproc),
            "--main_process_port",
            port,
            TRAIN,
            "--config",
            str(config),
            *overrides,
        ]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), f"--num_gpus={nproc}", f"--master_port={port}", TRAIN, "--config", str(config), *overrides]
    raise ValueError(launcher)


def _with_fresh_port(cmd: list[str]) -> list[str]:
    port = str(free_port())
    out = []
    for i, arg in enumerate(cmd):
        if arg.startswith("--master_port="):
            arg = f"--master_port={port}"
        elif i > 0 and cmd[i - 1] == "--main_process_port":
            arg = port
        out.append(arg)
    return out


def run(cmd: list[str], timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and ("EADDRINUSE" in proc.stderr or "address already in use" in proc.stderr.lower()):
        # free_port() releases the port before the launcher binds it; another process may take it
        proc = subprocess.run(_with_fresh_port(cmd), cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def side_by_side(*jobs: Callable[[], object]) -> list:
    """Run independent launches at once and return their results in order (an exception is
    raised where its result would be). A world-1 run (one thread) leaves one of the CI
    machine's 2 cores idle, so a second one beside it costs little wall time; results are the
    same (one thread per process: no reduction order depends on load). Not for DeepSpeed
    engines whose CPU ops may still be JIT-built (several at once race to build them), nor for
    tests that measure time or memory of the process."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]


def step_losses(output: Path) -> list[float]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def final_eval(output: Path) -> float:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["eval/loss"] for r in rows if "eval/loss" in r][-1]


def state_bytes(output: Path, rank: int) -> dict[str, int]:
    return json.loads((output / "state_bytes" / f"rank{rank}.json").read_text())["peak"]


def launch(script: str, args: list[str], world: int, timeout: float = 240.0) -> list[str]:
    """Run `world` ranks of `script`; returns each rank's combined output; fails on any error."""
    procs, _ = start(script, args, world)
    return finish(procs, f"{os.path.basename(script)} {args}", timeout)


def run_rank(worker: Callable[..., object], *args: str) -> NoReturn:
    """The end of every rank script a test launches, as harness's entry points end: `exit_process`.

    A rank that finished cleanly can still abort at interpreter exit (SIGABRT, "terminate called
    without an active exception") when a native thread (gloo's, DeepSpeed's, the store client's)
    is destroyed while joinable; seen in CI after every case of a loading run had passed."""
    try:
        worker(*args)
    except SystemExit as stop:  # a worker's own sys.exit(code) keeps its code
        exit_process(stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1))
    except BaseException:
        traceback.print_exc()
        exit_process(1)
    exit_process(0)


def start(script: str, args: list[str], world: int) -> tuple[list[subprocess.Popen], int]:
    """Like `launch` but returns immediately, so two worlds can run side by side.

    Each rank writes to a file of its own, not a pipe: a rank blocked on a full pipe (64 KiB,
    while the test waits on another rank) would stall the collective the others wait in."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = env()
        e.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            MKL_NUM_THREADS="1",
            TRANSFORMERS_OFFLINE="1",
        )
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen([sys.executable, script, *args], env=e, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
        proc.log = log  # type: ignore[attr-defined]
        procs.append(proc)
    return procs, port


def finish(procs: list[subprocess.Popen], what: str, timeout: float = 240.0) -> list[str]:
    outputs = []
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.log.seek(0)
            outputs.append(p.log.read())
            p.log.close()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            pytest.fail(f"rank {rank} of {what} failed ({p.returncode}):\n{out[-6000:]}")
    return outputs


# Warnings a fresh interpreter does not print (its default filters, outside __main__).
QUIET_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def call_entry_point(
    main: Callable[[list[str]], int],
    argv: list[str],
    launch_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> tuple[object, str, list]:
    """An entry point's `main(argv)` (`harness.train.main`, `harness.prune.main`) in this interpreter,
    in the environment a launched process would have (`launch_env`, e.g. `env()` plus a
    launcher's variables): (exit code, what it wrote on stderr, the warnings it raised that a
    process would print). For input that must be refused before any process group starts.

    Everything a call could leak into the next is set through monkeypatch, so it is undone
    when the test ends: os.environ (made equal to `launch_env`), the working directory (the
    repository, as `run` uses), sys.argv, the harness logger's rank (None, as in a fresh
    process: RANK decides) and `init_distributed`, replaced by a failure: input that got past
    pre-flight fails the test at once instead of waiting for ranks that never come.
    """
    import harness.log
    import harness.runner.command

    for key in set(os.environ) - set(launch_env):
        monkeypatch.delenv(key)
    for key, value in launch_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [sys.modules[main.__module__].__file__, *argv])  # as `python -m` sets it
    monkeypatch.setitem(harness.log._state, "rank", None)

    def no_process_group(*args, **kwargs):
        raise AssertionError("pre-flight let the input through: the entry point went on to start a process group")

    monkeypatch.setattr(harness.runner.command, "init_distributed", no_process_group)
    capfd.readouterr()  # only what the entry point writes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors, as a process would end
            code = exc.code
    shown = [w for w in caught if not issubclass(w.category, QUIET_WARNINGS)]
    return code, capfd.readouterr().err, shown


def signal_once_logged(
    cmds: list[list[str]], log_dir: Path, line: str, sig: int | list[int], env: dict[str, str], timeout: float = 180
) -> list[tuple[int, float, str]]:
    """Start each of `cmds` (the ranks of one run, or one process), send `sig` (or `sig[i]` to the
    i-th) to every one once each one's output holds `line`; per process: (exit code, seconds from
    its signal to its exit, its output)."""
    sigs = sig if isinstance(sig, list) else [sig] * len(cmds)
    logs = [log_dir / f"proc{i}.log" for i in range(len(cmds))]
    files = [open(p, "w") for p in logs]
    procs = [subprocess.Popen(c, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True) for c, f in zip(cmds, files)]
    try:
        deadline = time.monotonic() + timeout
        for proc, path in zip(procs, logs):
            while line not in path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, path.read_text()[-3000:]
                time.sleep(0.02)
        signalled = time.monotonic()
        for proc, one in zip(procs, sigs):
            proc.send_signal(one)
        codes = [proc.wait(timeout=120) for proc in procs]
        return [(code, time.monotonic() - signalled, path.read_text()) for code, path in zip(codes, logs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in files:
            f.close()
