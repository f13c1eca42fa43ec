"""The one object the trainer talks to: metrics file, W&B, progress, plots and summary.

Every rank constructs an `Observer` (so the trainer needs no `if rank == 0` around each
call), but only rank 0 does anything: other ranks create no file, no W&B run and print
nothing, which is what keeps N processes from writing N copies of every line.

Contract with the trainer (all values plain numbers; a one-element tensor is accepted and
stays unread, summed on its device, until its interval is written: a step between log steps
never waits for the device):

- `log_step(step, metrics)` after every optimizer step; `step` counts completed steps
  (1..total_steps). Names are those of `metrics.py`; a bare name gets the `train/` prefix.
  Give `perf/tokens_per_s` and `perf/samples_per_s` as *global* rates: the per-device
  rates (÷ world_size, every rank is a data-parallel replica) and `perf/mfu` are derived
  here. Steps between two logged ones (`logging.log_every`) are folded together: memory
  peaks keep their maximum, lr and skipped_steps their last value, the rest their mean.
- `log_eval(step, {"loss": x})` -> `eval/loss` and `eval/perplexity` = exp(loss).
- `log_prune(report)`: a `harness.pruning` `PruneReport` (or its `to_dict()`), or a nested or
  flat dict such as `{"sparsity": {layer: s}, "achieved_sparsity": a}`
  -> `prune/sparsity/<layer>`, `prune/achieved_sparsity`, `prune/<other numbers>`.
- `log_summary(d)` adds entries to the final summary; `close()` writes the plots, prints
  the summary table, finishes W&B and returns the summary.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from harness.log import get_logger

from ..config import LoggingConfig
from . import metrics as M
from . import mfu as mfu_lib
from .progress import Progress
from .summary import build_summary, format_table
from .wandb_logger import WandbLogger

log = get_logger(__name__)


def _warn(msg: str) -> None:
    log.warning(f"observability: {msg}")


class Observer:
    def __init__(
        self,
        run_dir: str,
        run_config: dict[str, Any],
        logging_cfg: LoggingConfig,
        rank: int,
        world_size: int,
        total_steps: int,
        *,
        seq_len: int | None = None,
        device: str = "auto",
        precision: str = "fp32",
        model_config: Any = None,
        flops_per_token: float | None = None,
        device_name: str | None = None,
        start_step: int = 0,
        stream: TextIO | None = None,
    ) -> None:
        """`run_config`: the run config as a plain dict, the record W&B keeps of the run (read
        for nothing else). `model_config` (an HF config) and `seq_len` give FLOPs/token for MFU
        unless `flops_per_token` is given; `precision` and the device (`device`, the run config's
        choice; `device_name` overrides the detected CUDA device) its peak FLOPs; `start_step > 0`
        (a resumed run) appends to the metrics file instead of starting it afresh."""
        self.active = rank == 0
        self.run_dir = run_dir
        self.cfg = logging_cfg
        self.world_size = max(1, world_size)
        self.total_steps = total_steps
        self.summary: dict[str, Any] = {}
        self._closed = False
        if not self.active:
            return
        self._t0 = time.monotonic()
        self._every = max(1, logging_cfg.log_every)
        self._last_step = start_step
        self._extra: dict[str, Any] = {}
        self._pending = M.IntervalAggregator()
        self._warned: set[str] = set()
        self.stream = stream if stream is not None else sys.stdout

        self.flops_per_token = flops_per_token
        if self.flops_per_token is None and model_config is not None and seq_len:
            try:
                self.flops_per_token = mfu_lib.flops_per_token(model_config, seq_len)
            except Exception as e:
                _warn(f"cannot count model FLOPs ({type(e).__name__}: {e}); MFU left out")
        self.device_name = device_name or mfu_lib.current_device_name(device)
        self.peak_flops = mfu_lib.peak_flops(self.device_name, precision, logging_cfg.peak_flops)

        self.writer = M.MetricsWriter(run_dir, append=start_step > 0, resumed_at=start_step if start_step > 0 else None)
        run_info = {
            "world_size": self.world_size,
            "total_steps": total_steps,
            "device_name": self.device_name or "cpu",
            "flops_per_token": self.flops_per_token,
            "peak_flops_per_device": self.peak_flops,
        }
        self.writer.write("start", start_step, run_info)
        self.wandb: WandbLogger | None = None
        if logging_cfg.wandb:
            self.wandb = WandbLogger(run_dir, run_config, logging_cfg.wandb_project, logging_cfg.run_name)
            if self.wandb.run is None:
                self.wandb = None
            else:
                self.wandb.update_config({"run_info": run_info})
        self.progress: Progress | None = None
        if logging_cfg.progress:
            self.progress = Progress(total_steps, every=self._every, start_step=start_step, stream=self.stream)

    # ------------------------------------------------------------------ helpers

    @property
    def wandb_mode(self) -> str:
        return self.wandb.mode if self.wandb is not None else "disabled"

    def _numbers(self, metrics: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in metrics.items():
            if value is None:  # not measured this step (e.g. the memory split runs every k steps)
                continue
            if M.deferred(value):  # read when its interval is written (a log step), not now
                out[key] = value
                continue
            number = M.as_number(value)
            if number is None:
                if key not in self._warned:
                    self._warned.add(key)
                    _warn(f"metric {key}={value!r} is not a number; not logged")
                continue
            out[key] = number
        return out

    def print(self, line: str) -> None:
        """A console line from rank 0 that does not tear the progress bar."""
        if not self.active:
            return
        if self.progress is not None:
            self.progress.write(line)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def _emit(self, kind: str, step: int, metrics: dict[str, Any]) -> None:
        self.writer.write(kind, step, metrics)
        if self.wandb is not None:
            self.wandb.log(metrics, step)

    def _flush(self) -> None:
        if self._pending:
            self._emit("train", self._last_step, self._pending.pop())

    # ------------------------------------------------------------------ API

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.active or self._closed:
            return
        m = self._numbers(M.with_section(metrics, "train"))
        for rate, per_device in ((M.TOKENS_PER_S, M.TOKENS_PER_S_DEVICE), (M.SAMPLES_PER_S, M.SAMPLES_PER_S_DEVICE)):
            if rate in m and per_device not in m:
                m[per_device] = m[rate] / self.world_size
        if M.MFU not in m and M.TOKENS_PER_S_DEVICE in m and self.flops_per_token and self.peak_flops:
            m[M.MFU] = mfu_lib.mfu(m[M.TOKENS_PER_S_DEVICE], self.flops_per_token, self.peak_flops)
        self._last_step = step
        if self.progress is not None:
            memory = m.get(M.MAX_ALLOCATED, m.get(M.MEMORY_TOTAL))
            categories = [m[M.memory_key(c)] for c in M.memory_categories(m)]
            bound = memory is None and bool(categories)
            loads = M.expert_loads(m)
            self.progress.update(
                step,
                loss=m.get(M.TRAIN_LOSS),
                memory_bytes=sum(categories) if bound else memory,
                memory_is_bound=bound,
                tokens_per_s=m.get(M.TOKENS_PER_S),
                aux_loss=m.get(M.TRAIN_AUX_LOSS),
                expert_load=max(loads.values()) if loads else None,
            )
        self._pending.add(m)
        if step % self._every == 0 or step >= self.total_steps:
            self._flush()

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.active or self._closed:
            return
        m = self._numbers(M.with_section(metrics, "eval"))
        if M.EVAL_LOSS in m and M.EVAL_PERPLEXITY not in m:
            try:
                m[M.EVAL_PERPLEXITY] = math.exp(m[M.EVAL_LOSS])
            except OverflowError:
                m[M.EVAL_PERPLEXITY] = math.inf
        self._flush()  # keep the file in step order
        self._emit("eval", step, m)
        self.print(f"eval @ step {step}: " + ", ".join(f"{k.split('/', 1)[1]} {v:.4g}" for k, v in m.items()))

    def log_prune(self, stats: Any, step: int | None = None) -> None:
        """A pruning report (see `metrics.prune_entries`); `step` defaults to the last step logged."""
        if not self.active or self._closed:
            return
        step = self._last_step if step is None else step
        flat = M.prune_entries(stats)
        numbers = {k: n for k, v in flat.items() if (n := M.as_number(v)) is not None}
        others = {k: v for k, v in flat.items() if k not in numbers}
        self._flush()
        self.writer.write("prune", step, {**numbers, **others})
        if self.wandb is not None:
            self.wandb.log(numbers, step)
            if others:
                self.wandb.update_summary(others)
            per_layer = {k[len(M.PRUNE_LAYER_PREFIX) :]: v for k, v in numbers.items() if k.startswith(M.PRUNE_LAYER_PREFIX)}
            if per_layer:
                self.wandb.log_sparsity_chart(per_layer, step)
        layers = sum(k.startswith(M.PRUNE_LAYER_PREFIX) for k in numbers)
        achieved = numbers.get(M.PRUNE_ACHIEVED)
        achieved_text = f"{100.0 * achieved:.2f}%" if achieved is not None else "n/a"
        kept, count = numbers.get("prune/experts/kept_per_layer"), numbers.get("prune/experts/count")
        experts = f", {kept:g} of {count:g} experts kept per MoE layer" if kept is not None else ""
        self.print(f"prune @ step {step}: achieved sparsity {achieved_text} over {layers} layers{experts}")

    def log_summary(self, values: dict[str, Any]) -> None:
        if self.active and not self._closed:
            self._extra.update(values)

    def close(self) -> dict[str, Any]:
        """Flush, draw plots, print the summary, finish W&B; idempotent. {} on other ranks."""
        if not self.active or self._closed:
            return self.summary
        self._closed = True
        self._flush()
        if self.progress is not None:
            self.progress.close()
        records = M.read_records(self.writer.path)
        summary = build_summary(records, self._extra)
        summary["wall_time_s"] = time.monotonic() - self._t0
        if self.flops_per_token:
            summary["flops_per_token"] = self.flops_per_token
        plots: dict[str, str] = {}
        if self.cfg.plots:
            try:
                from .plots import write_plots  # matplotlib only when drawing

                plots = write_plots(self.run_dir)
            except Exception as e:
                _warn(f"plots failed ({type(e).__name__}: {e})")
        summary["plots"] = plots
        summary["wandb_mode"] = self.wandb_mode
        if self.wandb is not None:
            summary["wandb_dir"] = self.wandb.dir
            if plots:
                self.wandb.log_images(plots, self._last_step)
            self.wandb.update_summary({f"summary/{k}": v for k, v in summary.items() if M.as_number(v) is not None})
            self.wandb.finish()
        self.writer.write("summary", self._last_step, summary)
        self.writer.close()
        self.stream.write(format_table(summary) + "\n")
        self.stream.flush()
        self.summary = summary
        return summary

    def __enter__(self) -> Observer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
