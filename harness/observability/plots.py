"""End-of-run PNG charts in the run directory, drawn from the metrics file.

- `loss.png`: training loss (and eval loss) over steps; eval perplexity beside it.
- `memory.png`: peak memory by category over steps, stacked, so each band shows what a
  technique removed; the tracker's total and the GPU's max_allocated / max_reserved are
  drawn as lines over it. When the categories are the split at the moment of the total
  peak (what `harness.memory.StepMemoryTracker` reports) the stack's height is that peak; when
  each is its own maximum the stack is an upper bound, and the lines are the truth.
- `throughput.png`: tokens/s (global and per device) and, when known, MFU.
- `moe.png` (a mixture-of-experts run): each layer's expert load (max/mean tokens per expert;
  1 is balanced) over steps, and the router's load-balancing loss beside it.

Reading the file rather than in-memory history lets the charts be redrawn for any run,
also one that crashed: `python -m harness.observability.plots <run_dir>`.
Figures are made with `matplotlib.figure.Figure` directly, not pyplot, so drawing needs
no display and changes no global backend of the training process.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from . import metrics as M

_DPI = 110


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def _category_colors(categories: list[str]) -> list[Any]:
    """A fixed colour per category, so the same band looks the same in every run's chart."""
    known = list(M.MEMORY_CATEGORIES) + ["model_buffers", "other"]
    extra = sorted(c for c in categories if c not in known)
    palette = colormaps["tab10"]
    return [palette((known + extra).index(c) % palette.N) for c in categories]


def _byte_unit(peak: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if peak >= scale:
            return unit, float(scale)
    return "B", 1.0


def _save(fig: Figure, path: str) -> str:
    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    return path


def plot_loss(train: list[dict[str, Any]], evals: list[dict[str, Any]], path: str) -> str | None:
    steps, loss = _series(train, M.TRAIN_LOSS)
    e_steps, e_loss = _series(evals, M.EVAL_LOSS)
    p_steps, ppl = _series(evals, M.EVAL_PERPLEXITY)
    if not loss and not e_loss:
        return None
    fig = Figure(figsize=(10 if ppl else 6, 4))
    ax = fig.add_subplot(1, 2 if ppl else 1, 1)
    if loss:
        ax.plot(steps, loss, label="train loss", linewidth=1.2)
    if e_loss:
        ax.plot(e_steps, e_loss, "o-", label="eval loss")
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if ppl:
        ax2 = fig.add_subplot(1, 2, 2)
        ax2.plot(p_steps, ppl, "o-", color="tab:green")
        ax2.set(xlabel="step", ylabel="perplexity", title="Eval perplexity")
        if max(ppl) / max(min(ppl), 1e-12) > 20:
            ax2.set_yscale("log")
        ax2.grid(alpha=0.3)
    return _save(fig, path)


def plot_memory(train: list[dict[str, Any]], path: str) -> str | None:
    # Categories that stay at zero (no communication on one rank, say) would only crowd the legend.
    categories = [c for c in M.memory_categories({k for r in train for k in r}) if any(_series(train, M.memory_key(c))[1])]
    lines = [k for k in (M.MEMORY_TOTAL, M.MAX_ALLOCATED, M.MAX_RESERVED) if _series(train, k)[0]]
    if not categories and not lines:
        return None
    rows = [r for r in train if any(isinstance(r.get(M.memory_key(c)), (int, float)) for c in categories)]
    steps = [r["step"] for r in rows]
    # A category missing at a step (not tracked that step) is drawn as 0 there.
    stacks = [[float(r.get(M.memory_key(c)) or 0) for r in rows] for c in categories]
    peak = max([sum(col) for col in zip(*stacks)] + [max(_series(train, k)[1]) for k in lines] + [1.0])
    unit, scale = _byte_unit(peak)
    fig = Figure(figsize=(9, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    if categories and steps:
        ax.stackplot(steps, [[v / scale for v in s] for s in stacks], labels=categories, colors=_category_colors(categories), alpha=0.85)
    for key, style in zip(lines, ("k-", "k--", "k:")):
        s, v = _series(train, key)
        ax.plot(s, [x / scale for x in v], style, label=key.split("/", 1)[1].removesuffix("_bytes"))
    ax.set(xlabel="step", ylabel=f"peak memory ({unit})", title="Peak memory by category")
    ax.grid(alpha=0.3)
    ax.set_ylim(0, 1.05 * peak / scale)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    return _save(fig, path)


def plot_throughput(train: list[dict[str, Any]], path: str) -> str | None:
    steps, tps = _series(train, M.TOKENS_PER_S)
    d_steps, tps_dev = _series(train, M.TOKENS_PER_S_DEVICE)
    m_steps, mfu = _series(train, M.MFU)
    if not tps and not tps_dev:
        return None
    fig = Figure(figsize=(10 if mfu else 6, 4))
    ax = fig.add_subplot(1, 2 if mfu else 1, 1)
    if tps:
        ax.plot(steps, tps, label="global")
    if tps_dev and tps_dev != tps:
        ax.plot(d_steps, tps_dev, "--", label="per device")
    ax.set(xlabel="step", ylabel="tokens/s", title="Throughput")
    ax.set_ylim(0, 1.15 * max(tps + tps_dev) or 1.0)
    ax.grid(alpha=0.3)
    ax.legend()
    if mfu:
        ax2 = fig.add_subplot(1, 2, 2)
        ax2.plot(m_steps, [100.0 * v for v in mfu], color="tab:purple")
        ax2.set(xlabel="step", ylabel="MFU (%)", title="Model FLOPs utilisation")
        ax2.set_ylim(0, 115.0 * max(mfu) or 1.0)
        ax2.grid(alpha=0.3)
    return _save(fig, path)


def plot_moe(train: list[dict[str, Any]], path: str) -> str | None:
    rows = [(r["step"], loads) for r in train if (loads := M.expert_loads(r))]
    a_steps, aux = _series(train, M.TRAIN_AUX_LOSS)
    if not rows and not aux:
        return None
    fig = Figure(figsize=(11 if aux else 7, 4.2))
    ax = fig.add_subplot(1, 2 if aux else 1, 1)
    layers = sorted({i for _, loads in rows for i in loads})
    palette = colormaps["viridis"]
    for n, layer in enumerate(layers):
        pts = [(s, loads[layer]) for s, loads in rows if layer in loads]
        color = palette(n / max(1, len(layers) - 1))
        ax.plot([s for s, _ in pts], [v for _, v in pts], color=color, linewidth=1.0, label=f"layer {layer}")
    ax.axhline(1.0, color="k", linestyle=":", linewidth=0.8)  # every expert the same tokens
    ax.set(xlabel="step", ylabel="max / mean tokens per expert", title="Expert load by layer")
    ax.grid(alpha=0.3)
    if 0 < len(layers) <= 12:
        ax.legend(fontsize="small", ncol=2 if len(layers) > 6 else 1)
    if aux:
        ax2 = fig.add_subplot(1, 2, 2)
        ax2.plot(a_steps, aux, color="tab:red")
        ax2.set(xlabel="step", ylabel="aux loss", title="Router load-balancing loss")
        ax2.grid(alpha=0.3)
    return _save(fig, path)


def write_plots(run_dir: str) -> dict[str, str]:
    """Draw every chart the run has data for; returns {name: path} of the PNGs written."""
    records = M.read_records(os.path.join(run_dir, M.METRICS_FILE))
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    written = {
        "loss": plot_loss(train, evals, os.path.join(run_dir, "loss.png")),
        "memory": plot_memory(train, os.path.join(run_dir, "memory.png")),
        "throughput": plot_throughput(train, os.path.join(run_dir, "throughput.png")),
        "moe": plot_moe(train, os.path.join(run_dir, "moe.png")),
    }
    return {name: p for name, p in written.items() if p is not None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Redraw a run's PNG charts from its metrics.jsonl")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    for path in write_plots(args.run_dir).values():
        print(path)


if __name__ == "__main__":
    main()
