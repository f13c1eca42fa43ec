"""Console progress on rank 0: a live bar on a terminal, plain lines everywhere else.

On a terminal, tqdm draws the bar (rate, elapsed, ETA) and we add loss and memory to its
postfix. When stdout is not a terminal (CI, SLURM's `--output` file, `| tee`), a redrawn
bar turns into one huge line of carriage returns, so we print one self-contained line per
logged step instead, e.g.

    step 20/100 (20%) | 3.41 step/s | 5.6e+03 tok/s | elapsed 00:05 | ETA 00:23 | loss 3.2104 | mem 1.21 GiB

(a mixture-of-experts run adds `aux 2.013 | load 1.42`: the router's loss, the most loaded layer's
max/mean tokens per expert)

Lines are flushed at once, so a job log shows where a run is even while it hangs.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

from .metrics import format_bytes


class Progress:
    """Progress of `total_steps` optimizer steps, resumed runs starting at `start_step`."""

    def __init__(
        self,
        total_steps: int,
        *,
        every: int = 1,
        start_step: int = 0,
        stream: TextIO | None = None,
        bar: bool | None = None,
    ) -> None:
        self.total = total_steps
        self.every = max(1, every)
        self.stream = stream if stream is not None else sys.stdout
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar_mode = is_tty if bar is None else bar
        self._start_step = start_step
        self._t0 = time.monotonic()
        self._bar: tqdm | None = None
        if self.bar_mode:
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=self.stream,
                unit="step",
                dynamic_ncols=True,
                leave=True,
            )

    @staticmethod
    def _postfix(
        loss: float | None,
        memory_bytes: float | None,
        memory_is_bound: bool,
        tokens_per_s: float | None,
        aux_loss: float | None = None,
        expert_load: float | None = None,
    ) -> str:
        parts = []
        if tokens_per_s is not None:
            parts.append(f"{tokens_per_s:,.0f} tok/s" if tokens_per_s >= 100 else f"{tokens_per_s:.3g} tok/s")
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if aux_loss is not None:
            parts.append(f"aux {aux_loss:.4g}")
        if expert_load is not None:
            parts.append(f"load {expert_load:.2f}")
        if memory_bytes is not None:
            parts.append(f"mem {'<= ' if memory_is_bound else ''}{format_bytes(memory_bytes)}")
        return " | ".join(parts)

    def update(
        self,
        step: int,
        *,
        loss: float | None = None,
        memory_bytes: float | None = None,
        memory_is_bound: bool = False,
        tokens_per_s: float | None = None,
        aux_loss: float | None = None,
        expert_load: float | None = None,
    ) -> None:
        """Report that `step` (1-based) finished. `memory_is_bound`: a sum of per-category peaks.
        `aux_loss`, `expert_load`: a mixture-of-experts router's loss and its most loaded layer's load."""
        postfix = self._postfix(loss, memory_bytes, memory_is_bound, tokens_per_s, aux_loss, expert_load)
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(max(0, step - self._bar.n))
            return
        if step % self.every and step != self.total:
            return
        elapsed = time.monotonic() - self._t0
        done = step - self._start_step
        rate = done / elapsed if elapsed > 0 and done > 0 else None
        eta = (self.total - step) / rate if rate else None
        fields = [
            f"step {step}/{self.total} ({100.0 * step / max(1, self.total):.0f}%)",
            f"{rate:.3g} step/s" if rate else "- step/s",
            f"elapsed {tqdm.format_interval(elapsed)}",
            f"ETA {tqdm.format_interval(eta) if eta is not None else '-'}",
        ]
        if postfix:
            fields.append(postfix)
        self.write(" | ".join(fields))

    def write(self, line: str) -> None:
        """Print a line without tearing the bar (eval results, warnings, the summary)."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
