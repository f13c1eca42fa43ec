"""Weights & Biases on rank 0: mode choice, dashboard layout, and never failing a run.

Mode, following W&B's own conventions:

1. `logging.wandb: false` -> no W&B at all.
2. `WANDB_MODE` (or the legacy `WANDB_DISABLED=true`) in the environment wins: `disabled`
   creates nothing, `offline`/`online` are passed on to wandb as they are.
3. An API key (`WANDB_API_KEY`, `WANDB_IDENTITY_TOKEN_FILE`, or a netrc entry for the
   server at `$NETRC` or `~/.netrc`) -> online, if the server answers a TCP connect within a
   few seconds; otherwise offline, so a cluster without egress never waits on it.
4. No key -> offline: the run is written under `<run_dir>/wandb/` and can be uploaded later
   with `wandb sync <run_dir>/wandb/offline-run-*`.

An online `wandb.init` that still fails (server slow, key rejected) is retried offline;
an offline one that fails turns W&B off with one warning. A failure in `log` also turns it
off: observability must never be the reason a training run dies. Timeouts default to
bounded values (init 30 s, login 10 s, finish 300 s) unless `WANDB_INIT_TIMEOUT`,
`WANDB_LOGIN_TIMEOUT` or `WANDB_FINISH_TIMEOUT` say otherwise.

Dashboard layout: W&B groups panels into sections by the prefix before the first `/`
(`train`, `perf`, `memory`, `moe`, `eval`, `prune`, `plots`); `define_metric` makes `train/step`
the x-axis of every chart and gives the run table useful summaries (min loss, max memory).
"""

from __future__ import annotations

import netrc
import os
import socket
import warnings
from typing import Any
from urllib.parse import urlparse

from harness.log import get_logger

from . import metrics as M

log = get_logger(__name__)

DEFAULT_BASE_URL = "https://api.wandb.ai"
_TIMEOUT_DEFAULTS = {"init_timeout": 30.0, "login_timeout": 10.0}
_ONLINE_FINISH_TIMEOUT = 300.0
_PROBE_TIMEOUT_S = 3.0
_TRUE = ("1", "true", "yes", "on")


def _warn(msg: str) -> None:
    log.warning(f"W&B: {msg}")


def has_api_key(env: dict[str, str] | None = None) -> bool:
    """Whether W&B would find credentials: the env variables, then netrc for the server's host."""
    env = dict(os.environ) if env is None else env
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL", DEFAULT_BASE_URL)).hostname
    path = env.get("NETRC") or os.path.expanduser("~/.netrc")
    if not host or not os.path.isfile(path):
        return False
    try:
        auth = netrc.netrc(path).authenticators(host)
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])


def server_reachable(env: dict[str, str] | None = None, timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """A TCP connect to the W&B server; behind a proxy we cannot probe, so assume yes."""
    env = dict(os.environ) if env is None else env
    if any(env.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return True
    url = urlparse(env.get("WANDB_BASE_URL", DEFAULT_BASE_URL))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_mode(enabled: bool, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(mode, why): mode is online | offline | disabled, per the module docstring."""
    env = dict(os.environ) if env is None else env
    if not enabled:
        return "disabled", "logging.wandb is false"
    if env.get("WANDB_DISABLED", "").lower() in _TRUE:
        return "disabled", "WANDB_DISABLED is set"
    env_mode = env.get("WANDB_MODE", "").strip().lower()
    if env_mode:
        mode = {"dryrun": "offline", "run": "online", "shared": "online"}.get(env_mode, env_mode)
        return mode, f"WANDB_MODE={env_mode}"
    if not has_api_key(env):
        return "offline", "no W&B API key (sync later with `wandb sync`)"
    if not server_reachable(env):
        return "offline", "W&B server unreachable (sync later with `wandb sync`)"
    return "online", "API key found"


def _settings_kwargs(mode: str, env: dict[str, str]) -> dict[str, float]:
    """Bounded timeouts, each unless the user set it through its WANDB_* variable."""
    defaults = dict(_TIMEOUT_DEFAULTS)
    if mode == "online":
        defaults["finish_timeout"] = _ONLINE_FINISH_TIMEOUT
    return {k: v for k, v in defaults.items() if f"WANDB_{k.upper()}" not in env}


def _metric_summaries() -> dict[str, str]:
    """Per-metric run summaries; W&B ignores `summary` on glob patterns, so names are explicit."""
    summaries = {
        M.TRAIN_LOSS: "min,last",
        M.TRAIN_AUX_LOSS: "min,last",
        M.EVAL_LOSS: "min,last",
        M.EVAL_PERPLEXITY: "min,last",
        M.TOKENS_PER_S: "mean,last",
        M.SAMPLES_PER_S: "mean,last",
        M.TOKENS_PER_S_DEVICE: "mean,last",
        M.SAMPLES_PER_S_DEVICE: "mean,last",
        M.MFU: "mean,last",
    }
    summaries.update({k: "max" for k in (M.MAX_ALLOCATED, M.MAX_RESERVED, M.MEMORY_TOTAL)})
    summaries.update({M.memory_key(c): "max" for c in M.MEMORY_CATEGORIES})
    return summaries


class WandbLogger:
    """One W&B run for rank 0; every method is a no-op once W&B is off."""

    def __init__(self, run_dir: str, run_config: dict[str, Any], project: str, name: str | None) -> None:
        self.mode, self.reason = resolve_mode(True)
        self.run: Any = None
        self.dir: str | None = None
        if self.mode == "disabled":
            return
        try:
            import wandb
        except ImportError:
            self.mode, self.reason = "disabled", "the wandb package is not installed"
            _warn(self.reason)
            return
        self._wandb = wandb
        env = dict(os.environ)
        kwargs: dict[str, Any] = dict(
            project=project,
            name=name or os.path.basename(os.path.abspath(run_dir)),
            config=run_config,
            job_type="train",
            reinit="create_new",
        )
        if "WANDB_DIR" not in env:
            os.makedirs(run_dir, exist_ok=True)
            kwargs["dir"] = run_dir
        # Leave the mode to wandb where the user set it (env, `wandb offline`); force
        # offline only where we decided it (no key, no network).
        explicit_mode = None if ("WANDB_MODE" in env or self.mode == "online") else self.mode
        self.run = self._init(kwargs, explicit_mode, env)
        if self.run is None and self.mode == "online":
            _warn(f"init failed online; logging offline instead ({self.reason})")
            self.mode = "offline"
            self.run = self._init(kwargs, "offline", env)
        if self.run is None:
            self.mode = "disabled"
            return
        offline = getattr(self.run, "offline", None)
        if offline is not None:
            self.mode = "offline" if offline else "online"
        self.dir = os.path.dirname(self.run.dir)  # the run's folder, above its files/
        self._guard("define_metric", self._define_metrics)

    def _init(self, kwargs: dict[str, Any], mode: str | None, env: dict[str, str]) -> Any:
        try:
            try:
                settings = self._wandb.Settings(**_settings_kwargs(mode or self.mode, env))
            except Exception:
                settings = self._wandb.Settings()
            return self._wandb.init(mode=mode, settings=settings, **kwargs)
        except Exception as e:
            self.reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            _warn(f"wandb.init ({mode or 'default'} mode) failed: {self.reason}")
            return None

    def _define_metrics(self) -> None:
        run = self.run
        run.define_metric(M.STEP, hidden=True)
        run.define_metric("*", step_metric=M.STEP)
        self._defined = set(_metric_summaries())
        for name, summary in _metric_summaries().items():
            run.define_metric(name, step_metric=M.STEP, summary=summary)

    def _define_new_memory_metrics(self, metrics: dict[str, Any]) -> None:
        """Any other `memory/*` series (a category we do not know in advance) also sums up as its max."""
        for name in metrics:
            if name.startswith("memory/") and name not in self._defined:
                self._defined.add(name)
                self.run.define_metric(name, step_metric=M.STEP, summary="max")

    def _guard(self, what: str, fn: Any) -> None:
        """Run one W&B call; on any error warn once, close the W&B run and carry on without it."""
        if self.run is None:
            return
        try:
            fn()
        except Exception as e:
            _warn(f"{what} failed ({type(e).__name__}: {e}); W&B logging stops, the run goes on")
            self.finish()
            self.mode, self.reason = "disabled", f"{what} failed"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        def _log() -> None:
            self._define_new_memory_metrics(metrics)
            self.run.log({**metrics, M.STEP: step})

        self._guard("log", _log)

    def log_sparsity_chart(self, per_layer: dict[str, float], step: int) -> None:
        """A bar chart of per-layer sparsity, readable where 200 scalar charts are not."""

        def _log() -> None:
            wandb = self._wandb
            table = wandb.Table(columns=["layer", "sparsity"], data=[[k, v] for k, v in per_layer.items()])
            chart = wandb.plot.bar(table, "layer", "sparsity", title="Sparsity by layer")
            self.run.log({"prune/sparsity_by_layer": chart, M.STEP: step})

        self._guard("sparsity chart", _log)

    def log_images(self, paths: dict[str, str], step: int) -> None:
        """End-of-run PNGs under `plots/`: the stacked memory chart W&B cannot draw itself."""
        self._guard("plots", lambda: self.run.log({**{f"plots/{k}": self._wandb.Image(p) for k, p in paths.items()}, M.STEP: step}))

    def update_summary(self, values: dict[str, Any]) -> None:
        self._guard("summary", lambda: self.run.summary.update(values))

    def update_config(self, values: dict[str, Any]) -> None:
        self._guard("config", lambda: self.run.config.update(values, allow_val_change=True))

    def finish(self) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run.finish()
        except Exception as e:
            _warn(f"finish failed ({type(e).__name__}: {e}); the local run files are kept for `wandb sync`")
