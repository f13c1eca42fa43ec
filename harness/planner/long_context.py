"""How long a sequence fits: the longest ``data.seq_len`` a config trains at on given devices.

Every other knob of the config stays as written; only the sequence length moves. Each probe
is the planner's normal estimate (`harness.planner.estimate`: the traced step with the
engine's model state over it) judged by the normal verdict (`harness.planner.report.verdict`:
device memory with the GPU allowance, host memory per node, the load phase), so the answer is
the same "fits" `harness.plan` prints for that length.

The search is a bisection over multiples of ``step`` tokens, with the next probe placed where
the straight line through the two bracketing probes crosses the budget (regula falsi): a
step's bytes grow linearly with the sequence length for a fixed config (attention here is
SDPA's memory-efficient kernels, never an s x s score matrix; the chunked loss bounds the
logits; packed instruction rows in one process are the exception: transformers' (B, 1, S, S) mask
grows with the square, and the bisection below takes over), so the line lands within a step or
two of the answer and each trace (seconds to a minute at 8B) is spent near it. Where the bytes
bend (two probes in a row move the same end of the bracket), the next probe bisects, so the search costs about twice a bisection at worst.
Before a probe fails, the lengths grow along the line through the last two (at least by half, at
most `GROWTH_LIMIT` times).

No probe is longer than the trainer takes for the model (`harness.config.sequence_limit`: its
positions, `model.max_seq_len`): an answer past the model's positions would be refused by the run.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.config import ParallelLayout, RunConfig, SequenceLimit, check_sequence_heads, sequence_limit
from harness.errors import ConfigError
from harness.models import model_config
from harness.planner.estimate import Estimate, estimate
from harness.planner.report import Verdict, gib, verdict

SEQ_STEP = 256  # default granularity of the answer, in tokens
SEQ_LIMIT = 1 << 24  # 16M tokens: the search's ceiling


def sequence_degree(cfg: RunConfig, world: int, vocab_size: int | None = None) -> int:
    """The sequence-parallel rung's degree: the largest N > 1 that divides the world and `data.seq_len`
    and that pre-flight's check of the model's heads accepts (`check_sequence_heads`); 1 (no such rung)
    when there is none, when the config already splits its sequences, or when the model's shape
    cannot be read. Packed instruction rows split too (Ulysses attends each example on its own).
    Anything else the trainer refuses with it (pruning, optimizer-in-backward in the user's
    config) the rung's row reports."""
    if ParallelLayout.of(cfg.parallel, world).splits_sequences:
        return 1
    try:
        shape = model_config(cfg.model.name, vocab_size=vocab_size).to_dict()
    except Exception:  # the first rung, the config as written, reports an unreadable model
        return 1
    for n in range(world, 1, -1):
        if world % n or cfg.data.seq_len % n:
            continue
        trial = copy.deepcopy(cfg)
        trial.parallel.sequence = n
        try:
            check_sequence_heads(trial.parallel, shape)
        except ConfigError:
            continue
        return n
    return 1


@dataclass
class Probe:
    seq_len: int
    fits: bool
    device_need: int  # per-rank device bytes the verdict compared (allowance included)
    host_need: int  # per-node host bytes
    reason: str
    estimate: Estimate | None = field(default=None, repr=False)


@dataclass
class SeqSearch:
    """The answer: ``longest`` (0: not even ``step`` tokens fit) and every probe made, in order;
    ``limit``: the longest the trainer takes for the model, which the search did not pass."""

    longest: int
    step: int
    probes: list[Probe]
    limit: SequenceLimit | None = None

    def capped(self) -> bool:
        """Whether the model's limit, not memory, ended the search (the longest probe fit)."""
        return self.limit is not None and self.longest > 0 and self.longest == self.limit.tokens // self.step * self.step

    def best(self) -> Probe | None:
        return next((p for p in self.probes if p.seq_len == self.longest and p.fits), None)

    def first_too_long(self) -> Probe | None:
        over = [p for p in self.probes if not p.fits]
        return min(over, key=lambda p: p.seq_len) if over else None


def trainer_limit(cfg: RunConfig, vocab_size: int | None = None) -> SequenceLimit | None:
    """The trainer's `sequence_limit` for the model (None where its config cannot be read: the
    first probe's trace reports that)."""
    try:
        shape = model_config(cfg.model.name, vocab_size=vocab_size).to_dict()
    except Exception:
        return None
    return sequence_limit(cfg.model, shape)


def _margin(p: Probe, gpu_mem: int, cpu_mem: int | None) -> float:
    """Bytes left over on the tighter of the two memories (negative: over)."""
    device = gpu_mem - p.device_need
    return min(device, cpu_mem - p.host_need) if cpu_mem is not None else device


def _next_probe(lo: Probe | None, hi: Probe, step: int, gpu_mem: int, cpu_mem: int | None) -> int:
    """The next sequence length inside (lo, hi): where the line through them crosses 0, else the middle."""
    lo_seq = lo.seq_len if lo is not None else 0
    middle = (lo_seq + hi.seq_len) // 2 // step * step
    if lo is None:
        return max(step, middle)
    m_lo, m_hi = _margin(lo, gpu_mem, cpu_mem), _margin(hi, gpu_mem, cpu_mem)
    if m_lo <= m_hi:  # not growing with the sequence: no line to follow
        return middle
    cross = lo.seq_len + (hi.seq_len - lo.seq_len) * m_lo / (m_lo - m_hi)
    guess = int(cross) // step * step
    if not lo.seq_len < guess < hi.seq_len:
        guess = guess + step if guess <= lo.seq_len else guess - step
    return guess if lo.seq_len < guess < hi.seq_len else middle


GROWTH_LIMIT = 4  # at most this many times the longest fitting probe, per probe, while growing


def _beyond(a: Probe, b: Probe, step: int, gpu_mem: int, cpu_mem: int | None) -> int:
    """Past where the line through two fitting probes crosses the budget (by a tenth), so the next
    probe is most likely the first over it; at least half again ``b`` (a curve the line
    underestimates still grows geometrically); twice ``b`` when the line does not fall. Never
    more than `GROWTH_LIMIT` times ``b``: where the peak is a moment the sequence barely moves (the
    optimizer step's, while activations are small) the line is nearly flat and crosses the budget
    millions of tokens out, and a probe there traces a step that long (SmolLM2 with recomputation
    on a 2.5 GiB budget: its third probe was 16M tokens, still tracing after 15 minutes)."""
    m_a, m_b = _margin(a, gpu_mem, cpu_mem), _margin(b, gpu_mem, cpu_mem)
    if m_a <= m_b:
        return 2 * b.seq_len
    cross = b.seq_len + (b.seq_len - a.seq_len) * m_b / (m_a - m_b)
    far = -(-int(max(cross * 1.1, b.seq_len * 1.5, b.seq_len + step)) // step) * step
    return min(far, GROWTH_LIMIT * b.seq_len)


def max_seq_len(
    cfg: RunConfig,
    world: int,
    gpu_mem: int,
    *,
    cpu_mem: int | None = None,
    per_node: int | None = None,
    target: str = "cuda",
    vocab_size: int | None = None,
    step: int = SEQ_STEP,
    limit: int = SEQ_LIMIT,
    estimate_fn: Callable[..., Estimate] = estimate,
    on_probe: Callable[[Probe], None] | None = None,
) -> SeqSearch:
    """The longest multiple of ``step`` tokens (at most ``limit``) at which ``cfg`` fits, and the probes
    that found it (under `parallel.sequence` N the step becomes a multiple of N: the answer's ``step``);
    ``on_probe`` hears of each as it is made (a probe at 8B traces for a minute or more)."""
    per_node = per_node or world
    split = cfg.parallel.sequence  # the split asked for (the trainer refuses a world it does not divide)
    step = math.lcm(step, split)  # sequence parallelism: every rank an equal slice
    model_limit = trainer_limit(cfg, vocab_size)
    if model_limit is not None:  # never past what the trainer takes
        limit = min(limit, model_limit.tokens)
        if limit < step:  # shorter than one step: the step shrinks to what still splits evenly
            step = max(split, limit // split * split)
        limit = limit // step * step
    probes: dict[int, Probe] = {}

    def probe(seq: int) -> Probe:
        if seq not in probes:
            at = copy.deepcopy(cfg)
            at.data.seq_len = seq
            est = estimate_fn(at, world, target=target, vocab_size=vocab_size)
            v: Verdict = verdict(est, gpu_mem, cpu_mem, per_node)
            probes[seq] = Probe(seq, v.fits, v.device_need, v.host_need_per_node or 0, v.reason, est)
            if on_probe is not None:
                on_probe(probes[seq])
        return probes[seq]

    start = min(limit, max(step, cfg.data.seq_len // step * step))
    lo: Probe | None = None
    hi: Probe | None = None
    first = probe(start)
    if first.fits:
        lo, seq, prev = first, start, None
        while hi is None and seq < limit:  # grow until a probe does not fit
            nxt = min(limit, max(2 * seq, seq + step) if prev is None else _beyond(prev, lo, step, gpu_mem, cpu_mem))
            result = probe(nxt)
            prev, lo, hi = (lo, result, None) if result.fits else (prev, lo, result)
            seq = nxt
    else:
        hi = first
    side: bool | None = None  # which end the last probe moved
    run = 0  # probes in a row that moved that same end: the line is bent, so the next one bisects
    while hi is not None and hi.seq_len - (lo.seq_len if lo else 0) > step:
        bisect = run >= 2
        middle = max(step, ((lo.seq_len if lo else 0) + hi.seq_len) // 2 // step * step)
        result = probe(middle if bisect else _next_probe(lo, hi, step, gpu_mem, cpu_mem))
        run = 0 if bisect else run + 1 if result.fits == side else 1
        side = result.fits
        lo, hi = (result, hi) if result.fits else (lo, result)
    ordered = list(probes.values())
    return SeqSearch(lo.seq_len if lo is not None else 0, step, ordered, model_limit)


def format_search(search: SeqSearch, gpu_mem: int, title: str) -> str:
    """The answer and each probe, in the order they were made."""
    lines = [title, ""]
    best, over = search.best(), search.first_too_long()
    if best is None:
        lines.append(f"Longest seq_len that fits: none (not even {search.step} tokens)")
    else:
        lines.append(f"Longest seq_len that fits: {search.longest:,} tokens (a multiple of {search.step}): {best.reason}")
    if over is not None:
        lines.append(f"  at {over.seq_len:,}: {over.reason}")
    if search.capped() and search.limit is not None:
        lines.append(f"  capped: {limit_note(search.limit)}")
    lines.append(f"  probes ({len(search.probes)}, each a traced step):")
    for p in search.probes:
        host = f", host {gib(p.host_need)}/node" if p.host_need else ""
        lines.append(f"    {p.seq_len:>10,}  {'fits ' if p.fits else 'over '} device {gib(p.device_need)} of {gib(gpu_mem)}{host}")
    return "\n".join(lines)


def limit_note(limit: SequenceLimit) -> str:
    """What caps the answer, and what extends it."""
    if limit.source == "model.max_seq_len":
        return f"model.max_seq_len={limit.tokens:,} is the longest the run takes; raise or unset it for more"
    return (
        f"the model's {limit.tokens:,} positions ({limit.source}) are the longest the run takes; a longer "
        f"context needs RoPE scaling in the model's config.json (rope_scaling / rope_parameters) with {limit.source} "
        "raised to the scaled length"
    )


__all__ = ["Probe", "SEQ_STEP", "SeqSearch", "format_search", "limit_note", "max_seq_len", "sequence_degree", "trainer_limit"]
