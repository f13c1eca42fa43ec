"""Failure handling: non-finite steps, preemption signals, out-of-memory, dead ranks.

Every policy here is decided *collectively*: a NaN on one rank, or a SIGTERM that reached
one rank first, is all-reduced so that every rank takes the same branch (skip, save,
stop). Diverging ranks are what turn a recoverable fault into a hang.

- Non-finite loss / gradient norm (`checkpoint.on_nonfinite`): `StepGuard.pre_step` agrees
  on the loss *before* the optimizer step, so the engine can skip the update (DeepSpeed
  applies a NaN step unless told otherwise, see `DeepSpeedEngine.step`); `skip` counts it,
  `stop` raises `NonFiniteError` naming the step and the last good checkpoint.
- SIGTERM / SIGUSR1 (SLURM preemption): the handler only sets a flag; the next step's
  all-reduce makes it global, the loop saves a checkpoint and exits 0 (the job requeues).
- Out of memory: `Supervisor` prints memory held by category and what the planner would
  change (`harness.oom`), then exits non-zero without waiting for the other ranks.
- A dead rank: gloo raises at once on a closed peer socket, NCCL would hang; either way a
  heartbeat through the rendezvous store (`PeerMonitor`) names the rank that stopped and
  makes the others exit within `HARNESS_PEER_TIMEOUT_S` (default 30 s), long before the
  collective timeout (`HARNESS_COLLECTIVE_TIMEOUT_S`, the backstop for hung-but-alive ranks).

Fault injection for tests and drills (`HARNESS_FAULT`, comma-separated):
`nan_loss@STEP[:RANK]` (the LM head's output becomes NaN in that step's forward),
`oom@STEP[:RANK]` (a real `torch.OutOfMemoryError` raised in that step's forward),
`signal@STEP[:RANK]` (the process sends itself SIGUSR1 in that step's forward),
`save_pause=SECONDS[@STEP]` (a checkpoint is fully written but not committed for that long).
"""
from __future__ import annotations

import datetime
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.distributed import DistInfo

EXIT_NONFINITE = 3
EXIT_OOM = 4
EXIT_PEER_LOST = 5
EXIT_CHECKPOINT = 6

_ACTIVE: dict[str, Any] = {"supervisor": None, "guard": None}


class NonFiniteError(RuntimeError):
    """The run stops on a non-finite loss/gradient (policy `stop`, or weights already corrupted)."""


# ------------------------------------------------------------------ fault injection


def _faults() -> list[tuple[str, str, int | None, int | None]]:
    """(name, value, step, rank) of each `name@STEP[:RANK]` or `name=VALUE[@STEP]` in HARNESS_FAULT."""
    out = []
    for item in filter(None, (s.strip() for s in os.environ.get("HARNESS_FAULT", "").split(","))):
        name, eq, rest = item.partition("=")
        if eq:  # name=VALUE[@STEP]
            value, _, step = rest.partition("@")
            out.append((name, value, int(step) if step else None, None))
        else:  # name@STEP[:RANK]
            name, _, where = item.partition("@")
            step, _, rank = where.partition(":")
            out.append((name, "", int(step), int(rank) if rank else None))
    return out


def fault_seconds(name: str, step: int) -> float:
    """Seconds of an injected pause at `step` (`save_pause=5` or `save_pause=5@4`); 0 when not injected."""
    for fname, value, fstep, _ in _faults():
        if fname == name and fstep in (None, step):
            return float(value)
    return 0.0


def _fault_step(name: str, rank: int) -> int | None:
    for fname, _, step, frank in _faults():
        if fname == name and frank in (None, rank):
            return step
    return None


def _install_fault_hooks(module: torch.nn.Module, guard: "StepGuard") -> None:
    """A forward hook on the LM head that injects the requested fault in one training step."""
    rank = guard.info.rank
    nan_step, oom_step, signal_step = _fault_step("nan_loss", rank), _fault_step("oom", rank), _fault_step("signal", rank)
    if nan_step is None and oom_step is None and signal_step is None:
        return
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is None:
        raise RuntimeError("HARNESS_FAULT needs a model with an output embedding (LM head)")

    def hook(mod: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        step = guard.steps_done + 1
        if not mod.training:
            return output
        if step == signal_step and not _signal_received():  # as SLURM would: a real SIGUSR1 to this process
            os.kill(os.getpid(), signal.SIGUSR1)
        if step == oom_step:
            raise torch.OutOfMemoryError(f"injected by HARNESS_FAULT=oom@{oom_step}: tried to allocate the LM-head output")
        if step == nan_step:
            return output * float("nan")
        return output

    head.register_forward_hook(hook)


# ------------------------------------------------------------------ finiteness


def _local_tensors(engine: Any) -> list[torch.Tensor]:
    """The weights this rank holds: FSDP2 local shards, ZeRO-3 partitions, else the parameters."""
    out = []
    for p in engine.model.parameters():
        t = getattr(p, "ds_tensor", None)
        if t is None:
            t = p.to_local() if hasattr(p, "to_local") else p
        if t.numel():
            out.append(t.detach())
    return out


def _all_true(flag: bool, info: DistInfo) -> bool:
    if not info.distributed or info.world_size == 1:
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int32, device=info.device if info.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) == 0


def weights_finite(engine: Any, info: DistInfo) -> bool:
    """Whether every rank's weights are finite (collective)."""
    local = all(bool(torch.isfinite(t).all()) for t in _local_tensors(engine))
    return _all_true(local, info)


# ------------------------------------------------------------------ the step guard


class StepGuard:
    """Per-step agreement on non-finite losses and stop requests, and the skip/stop policy."""

    def __init__(self, cfg: Any, info: DistInfo, engine: Any, tracker: Any = None,
                 last_checkpoint: Callable[[], str | None] = lambda: None, start_step: int = 0):
        self.policy = cfg.checkpoint.on_nonfinite
        self.fp16 = cfg.precision == "fp16"
        self.info, self.engine, self.tracker = info, engine, tracker
        self.last_checkpoint = last_checkpoint
        self.start_step = self.steps_done = start_step
        self.stop_requested = False
        self.nonfinite_steps = 0
        self._bad_loss = False
        _ACTIVE["guard"] = self
        _install_fault_hooks(engine.module, self)

    def pre_step(self, local_loss: float) -> bool:
        """Before the optimizer step (collective): True when any rank's loss is non-finite: skip the update."""
        flags = torch.tensor([0.0 if math.isfinite(local_loss) else 1.0, 1.0 if _signal_received() else 0.0])
        if self.info.distributed and self.info.world_size > 1:
            flags = flags.to(self.info.device if self.info.backend == "nccl" else "cpu")
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._bad_loss = bool(flags[0] > 0)
        self.stop_requested = bool(flags[1] > 0)
        return self._bad_loss

    def post_step(self, result: Any) -> None:
        """After the step: apply the policy (skip: count and go on; stop: NonFiniteError)."""
        self.steps_done += 1
        step = self.steps_done
        # fp16: an inf gradient norm is the loss scaler's routine overflow, not a divergence.
        bad_norm = not math.isfinite(result.grad_norm) and not self.fp16
        if not (self._bad_loss or bad_norm):
            return
        self.nonfinite_steps += 1
        what = "loss" if self._bad_loss else "gradient norm"
        last = self.last_checkpoint() or "none saved yet"
        applied = not result.skipped or getattr(self.engine, "oib", None) is not None  # optimizer-in-backward stepped already
        if applied and not weights_finite(self.engine, self.info):
            raise NonFiniteError(f"non-finite {what} at step {step} was applied to the weights (this engine cannot skip it); "
                                 f"last good checkpoint: {last}")
        if self.policy == "stop":
            raise NonFiniteError(f"non-finite {what} at step {step}; stopping (checkpoint.on_nonfinite=stop). "
                                 f"Last good checkpoint: {last} (resume with checkpoint.resume=<it>, e.g. with a lower optim.lr)")
        if self.info.is_main:
            print(f"[harness] step {step}: non-finite {what}; update skipped ({self.nonfinite_steps} so far, "
                  "checkpoint.on_nonfinite=skip)", flush=True)


# ------------------------------------------------------------------ signals


_SIGNAL = {"received": None}


def _on_signal(signum: int, frame: Any) -> None:  # noqa: ARG001
    _SIGNAL["received"] = signum  # acted on at the next step boundary, by every rank together


def _signal_received() -> bool:
    return _SIGNAL["received"] is not None


def install_signal_handlers() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, _on_signal)


# ------------------------------------------------------------------ dead ranks


def collective_timeout_s() -> float:
    """The process group's collective timeout: the backstop for a rank that hangs while alive."""
    return float(os.environ.get("HARNESS_COLLECTIVE_TIMEOUT_S", "600"))


class PeerMonitor:
    """Heartbeats through the rendezvous store; names a rank that stopped and makes every rank exit.

    Each rank increments its counter every `interval` seconds and watches the next rank's
    (a ring: O(1) store traffic per rank). A counter that has not moved for `timeout`
    seconds means that rank died or hangs outside Python; the watcher posts the verdict
    in the store, and every rank's monitor, seeing it, prints it and exits.
    """

    def __init__(self, info: DistInfo, interval: float = 1.0, timeout: float | None = None):
        self.info = info
        self.interval = interval
        self.timeout = timeout if timeout is not None else float(os.environ.get("HARNESS_PEER_TIMEOUT_S", "30"))
        self.prefix = f"harness/hb/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.store = self._connect()
        self.agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harness-peer-monitor", daemon=True)

    def _connect(self) -> Any:
        """A store client of our own, with a short timeout, so a lost store fails fast and blocks nothing else."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if addr and port:
            try:
                return dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
            except Exception:  # noqa: BLE001 - fall back to the process group's own client
                pass
        return dist.distributed_c10d._get_default_store()

    def start(self) -> "PeerMonitor":
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self.store.set(f"{self.prefix}done/{self.info.rank}", "1")
        except Exception:  # noqa: BLE001 - the store may be gone at shutdown
            pass

    def _beat(self) -> int:
        return self.store.add(f"{self.prefix}{self.info.rank}", 1)

    def _count(self, rank: int) -> int:
        return self.store.add(f"{self.prefix}{rank}", 0)

    def _done(self, rank: int) -> bool:
        return self.store.check([f"{self.prefix}done/{rank}"])

    def _store_lost(self) -> str:
        host = "the torchrun agent of the first node" if self.agent_store else "rank 0"
        return (f"lost the rendezvous store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}, hosted by "
                f"{host}: {'it' if self.agent_store else 'rank 0'} died or its node is unreachable")

    def _exit(self, message: str) -> None:
        print(f"harness: error: rank {self.info.rank}: {message}; exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_PEER_LOST)

    def _run(self) -> None:
        peer = (self.info.rank + 1) % self.info.world_size
        last_count, last_change = -1, time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                if self.store.check([f"{self.prefix}dead"]):
                    self._exit(self.store.get(f"{self.prefix}dead").decode())
                count = self._count(peer)
                now = time.monotonic()
                if count != last_count:
                    last_count, last_change = count, now
                elif now - last_change > self.timeout and not self._done(peer):
                    verdict = f"rank {peer} died or hangs (no heartbeat for {now - last_change:.0f} s, noticed by rank {self.info.rank})"
                    self.store.set(f"{self.prefix}dead", verdict)
                    self._exit(verdict)
            except Exception:  # noqa: BLE001 - the store itself is gone
                if self._stop.is_set():
                    return
                self._exit(self._store_lost())

    def probe(self) -> str | None:
        """After a failed collective: which ranks stopped beating (a few intervals' watch), or None."""
        try:
            if self.store.check([f"{self.prefix}dead"]):
                return self.store.get(f"{self.prefix}dead").decode()
            peers = [r for r in range(self.info.world_size) if r != self.info.rank]
            first = {r: self._count(r) for r in peers}
            time.sleep(3 * self.interval)
            dead = [r for r in peers if self._count(r) == first[r] and not self._done(r)]
        except Exception:  # noqa: BLE001
            return self._store_lost()
        if not dead:
            return None
        names = ", ".join(f"rank {r}" for r in dead)
        return f"{names} died (no heartbeat; a collective with {'it' if len(dead) == 1 else 'them'} failed)"


# ------------------------------------------------------------------ the supervisor


class Supervisor:
    """Wraps a run: signal handlers and peer monitor in; exceptions out as one message and an exit code.

        with Supervisor(cfg, info):
            train(...)
    """

    def __init__(self, cfg: Any, info: DistInfo):
        self.cfg, self.info = cfg, info
        self.monitor: PeerMonitor | None = None

    def __enter__(self) -> "Supervisor":
        install_signal_handlers()
        if self.info.distributed and self.info.world_size > 1:
            self.monitor = PeerMonitor(self.info).start()
        _ACTIVE["supervisor"] = self
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        from harness.checkpoint import CheckpointError

        if exc is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            if self.monitor is not None:
                self.monitor.stop()
            return False
        from harness.oom import is_oom, oom_report

        if is_oom(exc):
            print(oom_report(exc, self.cfg, self.info, _ACTIVE["guard"]), file=sys.stderr, flush=True)
            self._hard_exit(EXIT_OOM)
        if isinstance(exc, (NonFiniteError, CheckpointError)):
            # Raised on every rank alike (the decision was all-reduced): a clean, agreed exit.
            if self.monitor is not None:
                self.monitor.stop()
            if self.info.is_main:
                print(f"harness: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_NONFINITE if isinstance(exc, NonFiniteError) else EXIT_CHECKPOINT)
        if self.monitor is not None:
            verdict = self.monitor.probe()
            if verdict:
                detail = (str(exc).splitlines() or [""])[0][:160]
                print(f"harness: error: rank {self.info.rank}: {verdict}; exiting ({type(exc).__name__}: {detail})",
                      file=sys.stderr, flush=True)
                self._hard_exit(EXIT_PEER_LOST)
            self.monitor.stop()
        return False  # an ordinary bug: the traceback

    @staticmethod
    def _hard_exit(code: int) -> None:
        """Exit now: with a peer gone, process-group teardown and atexit handlers could block forever."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
