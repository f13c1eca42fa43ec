"""The end-of-run summary: a dict for callers and W&B, and a short table for the console.

It is computed from the events the run actually logged (the metrics file), not from
running totals kept on the side, so the printed table, `close()`'s return value and the
file always agree. Throughput and MFU are averaged over the logged intervals after the
first one, because the first contains start-up work (allocator warm-up, compilation)
that says nothing about steady-state speed; with a single interval it is used as is.
With `logging.log_every > 1` a logged value is the interval's mean (loss) or maximum
(memory), so `train/loss_final` is the mean loss of the last logged interval. A
mixture-of-experts run's expert load (one series per layer) is summed up by the last
interval's most imbalanced layer, its index, and the mean over layers.
"""

from __future__ import annotations

from typing import Any

from . import metrics as M

_MEAN_KEYS = (M.TOKENS_PER_S, M.TOKENS_PER_S_DEVICE, M.SAMPLES_PER_S, M.SAMPLES_PER_S_DEVICE, M.MFU, M.STEP_TIME)


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in records if isinstance(r.get(key), (int, float))]


def _last(vals: list[float]) -> float:
    return vals[-1]


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals)


def build_summary(records: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Key results of a run from its metrics-file events, then `extra` (it wins on a clash)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    prune = [r for r in records if r.get("kind") == "prune"]
    out: dict[str, Any] = {}
    if train:
        out["steps"] = train[-1]["step"]
    steady = train[1:] if len(train) > 1 else train
    memory_keys = [M.memory_key(c) for c in M.memory_categories({k for r in train for k in r})]
    # (the events, the metric, {summary key: what of the metric's logged values}); a metric never logged adds nothing
    rows = [
        (train, M.TRAIN_LOSS, {"train/loss_final": _last, "train/loss_min": min}),
        (train, M.TRAIN_SKIPPED, {M.TRAIN_SKIPPED: _last}),
        *((steady, key, {f"{key}_mean": _mean}) for key in _MEAN_KEYS),
        *((train, key, {key: max}) for key in memory_keys + [M.MEMORY_TOTAL, M.MAX_ALLOCATED, M.MAX_RESERVED]),
        (evals, M.EVAL_LOSS, {"eval/loss_final": _last}),
        (evals, M.EVAL_PERPLEXITY, {"eval/perplexity_final": _last, "eval/perplexity_best": min}),
        (train, M.TRAIN_AUX_LOSS, {"train/aux_loss_final": _last}),
        (prune, M.PRUNE_ACHIEVED, {M.PRUNE_ACHIEVED: _last}),
    ]
    for events, metric, picks in rows:
        vals = _values(events, metric)
        if vals:
            out.update((name, pick(vals)) for name, pick in picks.items())
    loads = next((found for r in reversed(train) if (found := M.expert_loads(r))), {})
    if loads:  # the last logged interval's: its most imbalanced layer, and the mean over layers
        worst = max(loads, key=loads.__getitem__)
        out["moe/expert_load_worst"], out["moe/expert_load_worst_layer"] = loads[worst], worst
        out["moe/expert_load_mean"] = sum(loads.values()) / len(loads)
    out.update(extra or {})
    return out


def _format_value(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_bytes"):
        return M.format_bytes(value)
    if key.startswith(M.MFU) or "sparsity" in key:
        return f"{100.0 * value:.2f}%"
    if isinstance(value, int):
        return f"{value:,}"
    if key.endswith("_s") or "per_s" in key:
        return f"{value:,.2f}"
    return f"{value:.4g}"


def format_table(summary: dict[str, Any], title: str = "Run summary") -> str:
    """A two-column text table; nested or list values (e.g. plot paths) are left out."""
    rows = [(k, _format_value(k, v)) for k, v in summary.items() if not isinstance(v, (dict, list, tuple))]
    if not rows:
        return f"{title}: nothing was logged"
    width_k = max(len(k) for k, _ in rows)
    width_v = max(len(v) for _, v in rows)
    rule = f"+-{'-' * width_k}-+-{'-' * width_v}-+"
    lines = [title, rule]
    lines += [f"| {k.ljust(width_k)} | {v.rjust(width_v)} |" for k, v in rows]
    lines.append(rule)
    return "\n".join(lines)
