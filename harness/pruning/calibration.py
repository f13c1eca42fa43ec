"""Calibration passes through the trainer's own model or engine, and the statistics they feed.

Three statistics, all gathered with hooks or from the engine's own reduced gradients:
- input-activation norms ||X_j||_2 per input feature (Wanda), from forward pre-hooks; a
  stacked expert tensor's per expert, over the tokens routed to it (`ExpertInputs`);
- input Hessians H = X^T X (SparseGPT), from the same hooks, all-reduced across ranks;
- G = element-wise max over probe steps of |dL/dW| (GradProbe), read from each rank's
  gradient shard after the engine's backward (already reduce-scattered), stored in bf16.

One backward yields every layer's gradient, so a group of K layers costs the same passes
as one layer: K only bounds the memory of the statistics. What a pass costs does depend on
the group where the model is held whole (one process, DDP): the runner then asks autograd
for the probed weights' gradients alone, so the backward stops at the lowest probed layer
and computes no other weight gradient, and the blocks below are replayed (`prefix.py`):
one matrix of SmolLM2-135M's 30 blocks costs 1.5x (block 0) to 6x (block 29) less per pass.
Sharded engines reduce gradients inside their own backward hooks and always run the full
backward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from harness.distributed import Collectives
from harness.engine import gradient_probe
from harness.errors import StopRequested
from harness.memory import available_bytes
from harness.pruning.prefix import PrefixCache
from harness.pruning.shards import ShardView

LossFn = Callable[[Any, Any], torch.Tensor]

# Bytes per local weight element held while a group is probed: G0 and G1 in 2-byte
# floats, the pool/candidate masks, the saved values of scaled weights (fp32, at most
# all of them), and the int64 keys + indices built while selecting.
PROBE_BYTES_PER_ELEMENT = 2 + 2 + 2 + 4 + 16
# Fraction of the free memory the statistics may use when K is chosen automatically:
# the rest is left for activations, allocator fragmentation and the engine's buffers.
MEMORY_FRACTION = 0.5


class Ledger:
    """Bytes held by the pipeline's own buffers (statistics, masks, saved weights), with peak.

    A ledger instead of the allocator's peak because on CPU there is no resettable peak,
    and because the probe-memory target bounds exactly these buffers.
    """

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.peak = 0

    def add(self, key: str, t: torch.Tensor | int) -> None:
        self.held[key] = self.held.get(key, 0) + (t if isinstance(t, int) else t.numel() * t.element_size())
        self.peak = max(self.peak, sum(self.held.values()))

    def drop(self, prefix: str) -> None:
        for key in [k for k in self.held if k.startswith(prefix)]:
            del self.held[key]


class Runner:
    """Forward and backward passes of the trainer's model/engine, the way its strategy needs.

    A probe step is `accum` micro-batches per rank: for a DeepSpeed engine its own
    gradient_accumulation_steps (its backward divides the loss), otherwise `grad_accum`
    (the loss is divided here). A world-1 run with accum 2 therefore sees bit-identical
    gradients to a world-2 run with accum 1 on the same micro-batches.
    """

    def __init__(
        self,
        model_or_engine: Any,
        loss_fn: LossFn,
        grad_accum: int | None = None,
        comm: Collectives | None = None,
        probed_only: bool = True,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.target = model_or_engine
        # Asked before every probe step and forward micro-batch, on every rank at the same point
        # (it may be a collective): True ends the pruning there with StopRequested.
        self.should_stop = should_stop
        self.comm = comm or Collectives()
        self.probed_only = probed_only  # False: every probe runs the full forward and backward (the reference for tests)
        self.loss_fn = loss_fn
        self.probe = gradient_probe(model_or_engine, grad_accum)  # how this engine runs a backward that must not step
        self.module: nn.Module = self.probe.module
        self.accum = self.probe.accum
        self.prefix = PrefixCache(self.module, lambda: available_bytes(next(self.module.parameters()).device))
        self.fwd_batches = 0  # micro-batches run forward only
        self.fwd_bwd_batches = 0  # micro-batches run forward + backward

    def steps(self, batches: list[Any]) -> list[list[Any]]:
        if len(batches) % self.accum:
            raise ValueError(f"{len(batches)} calibration micro-batches is not a multiple of the accumulation {self.accum}")
        return [batches[i : i + self.accum] for i in range(0, len(batches), self.accum)]

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """Dropout off during probing (as the reference does); restores the previous mode."""
        was_training = self.module.training
        self.module.eval()
        try:
            yield
        finally:
            self.module.train(was_training)

    def _check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            done = self.fwd_batches + self.fwd_bwd_batches
            raise StopRequested(f"stop requested while pruning, after {done:g} calibration micro-batches; the pruning was not finished")

    def forward(self, batch: Any) -> None:
        self._check_stop()
        with torch.no_grad():
            self.loss_fn(self.target, batch)
        self.fwd_batches += 1

    def forward_backward(self, step: list[Any], probed: Sequence[ShardView] = ()) -> None:
        """Accumulate the reduced gradient of one probe step; the caller reads then zeroes it.

        `probed`: the views whose gradients the caller reads. Where this process holds their
        weights whole, only theirs are computed, and the blocks below the lowest of them are
        replayed from the first pass that probed it (`_probed_backward`); other parameters'
        `.grad` is then left as it was.
        """
        self._check_stop()
        params = [v.param for v in probed]
        if params and self._computes_probed_only(params):
            self._probed_backward(step, params, min(v.target.unit for v in probed))
            return
        self.probe.backward_step([functools.partial(self._counted_loss, batch) for batch in step])

    def _counted_loss(self, batch: Any) -> torch.Tensor:
        self.fwd_bwd_batches += 1
        return self.loss_fn(self.target, batch)

    def _computes_probed_only(self, probed: Sequence[nn.Parameter]) -> bool:
        """Whether the engine lets the probed weights' gradients be computed alone (whole weights)."""
        return self.probed_only and self.probe.computes_alone(probed)

    def _probed_backward(self, step: list[Any], params: list[nn.Parameter], lowest: int) -> None:
        """The probed weights' gradients alone, accumulated into their `.grad` as `backward` would
        (averaged over ranks by the probe where a wrapper would have: `partial_backward`).
        Optimizer-in-backward hooks do not fire: `autograd.grad` accumulates nothing.
        """
        with self.probe.partial_backward(params, self.comm):
            for batch in step:
                grads = torch.autograd.grad(self._probe_loss(batch, lowest) / self.accum, params)
                for p, g in zip(params, grads):
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)
                self.fwd_bwd_batches += 1

    def _probe_loss(self, batch: Any, lowest: int) -> torch.Tensor:
        """The loss of `batch`, blocks below `lowest` replayed where the prefix cache allows;
        the first replay of the run is checked bit for bit against a full forward."""
        prefix = self.prefix
        if not prefix.has(batch, lowest):
            with prefix.capturing(batch, lowest):
                return self.loss_fn(self.target, batch)
        full = None
        if not prefix.verified:
            full = self.loss_fn(self.target, batch).detach()
            self.fwd_batches += 1
        with prefix.replaying(batch, lowest):
            loss = self.loss_fn(self.target, batch)
        if full is not None:
            if not torch.equal(loss.detach(), full):
                prefix.disable("a replayed forward differed from the full one: the blocks are not a plain chain")
                return self.loss_fn(self.target, batch)
            prefix.verified = True
        prefix.replays += 1
        return loss

    def zero_grad(self) -> None:
        self.probe.zero_grad()


class ExpertInputs:
    """The inputs each expert of a transformers experts module sees, from its call's arguments
    (hidden states, each token's top-k experts): its projection's input is the tokens routed to
    it, and its down projection's is the gated activation of those, recomputed here with the
    module's own weights and gate (`_apply_gate`, `is_transposed`, biases) as transformers'
    implementations compute it. Read-only: the forward itself is untouched."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.signature = inspect.signature(module.forward)  # transformers' wrapper keeps the family's (__wrapped__)

    def routed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens x hidden, tokens x experts bool: which experts each token is routed to)."""
        hidden, index = list(self.signature.bind(*args, **kwargs).arguments.values())[:2]
        x = hidden.detach().reshape(-1, hidden.shape[-1])
        experts = self.module.num_experts
        picked = torch.nn.functional.one_hot(index.detach().reshape(x.shape[0], -1).clamp(max=experts), experts + 1)
        return x, picked[..., :experts].sum(1) > 0

    @torch.no_grad()
    def gated(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """The down projection's input for `x`, tokens routed to `expert`."""
        m = self.module
        w = (m.gate_up_proj if m.has_gate else m.up_proj)[expert]
        h = x @ w if m.is_transposed else x @ w.T
        if m.has_bias:
            h = h + (m.gate_up_proj_bias if m.has_gate else m.up_proj_bias)[expert]
        return m._apply_gate(h) if m.has_gate else m.act_fn(h)


class InputStats:
    """Forward pre-hooks accumulating, per target, sum_t x_tj^2 and optionally X^T X (fp64).

    Linears fed the very same input tensor (q/k/v, gate/up) share one accumulator, which
    cuts Hessian memory by up to 3x on transformer blocks. A stacked expert tensor's sums are
    per expert (`experts x inputs`, the order `ShardView.features` indexes); no Hessian.
    """

    def __init__(self, views: list[ShardView], hessian: bool, ledger: Ledger | None = None) -> None:
        self.views = views
        self.hessian = hessian
        self.ledger = ledger
        self.sumsq: dict[str, torch.Tensor] = {}
        self.H: dict[str, torch.Tensor] = {}
        self.alias: dict[str, str] = {}
        self._handles: list[Any] = []
        self._last: tuple[Any, str] | None = None

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if self._last is not None and self._last[0] is x:
                source = self._last[1]
                if self.alias.setdefault(name, source) != source:
                    raise RuntimeError(f"{name}: input sharing changed between batches")
                return
            if name in self.alias:
                raise RuntimeError(f"{name}: input sharing changed between batches")
            self._last = (x, name)
            x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
            if name not in self.sumsq:
                self.sumsq[name] = torch.zeros(x2.shape[1], dtype=torch.float64, device=x2.device)
                if self.hessian:
                    self.H[name] = torch.zeros(x2.shape[1], x2.shape[1], dtype=torch.float64, device=x2.device)
                    if self.ledger is not None:
                        self.ledger.add(f"stats/H/{name}", self.H[name])
            self.sumsq[name] += (x2 * x2).sum(0)
            if self.hessian:
                self.H[name] += x2.T @ x2

        return hook

    def _experts_hook(self, views: list[ShardView]) -> Callable[..., None]:
        inputs = ExpertInputs(views[0].target.module)

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x, routed = inputs.routed(args, kwargs)
            for v in views:
                acc = self.sumsq.setdefault(v.name, torch.zeros(v.feature_count, dtype=torch.float64, device=x.device))
                per_expert = acc.view(v.target.experts, -1)
                if v.target.attr != "down_proj":
                    per_expert += routed.T.double() @ x.double().square()
                    continue
                for e in routed.any(0).nonzero().flatten().tolist():
                    per_expert[e] += inputs.gated(x[routed[:, e]], e).double().square().sum(0)

        return hook

    def __enter__(self) -> InputStats:
        experts: dict[int, list[ShardView]] = {}
        for v in self.views:
            if v.target.experts:
                if self.hessian:
                    raise ValueError(f"{v.name}: input Hessians of stacked expert tensors are not collected")
                experts.setdefault(id(v.target.module), []).append(v)
                continue
            self._handles.append(v.target.module.register_forward_pre_hook(self._hook(v.name)))
        for group in experts.values():
            self._handles.append(group[0].target.module.register_forward_pre_hook(self._experts_hook(group), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._last = None

    def finalize(self, comm: Collectives) -> None:
        """Sum the statistics of all ranks (each saw its own micro-batches); one collective per kind."""
        names = sorted(self.sumsq)
        missing = [v.name for v in self.views if v.name not in self.sumsq and v.name not in self.alias]
        if missing:
            raise RuntimeError(f"no calibration input reached {missing[0]}")
        if names:
            flat = comm.all_reduce_sum(torch.cat([self.sumsq[n] for n in names]))
            for n, part in zip(names, torch.split(flat, [self.sumsq[n].numel() for n in names])):
                self.sumsq[n] = part
            if self.hessian:
                for n in names:  # one per matrix: a flat concat would double the peak
                    self.H[n] = comm.all_reduce_sum(self.H[n])

    def norms(self, name: str) -> torch.Tensor:
        """||X_j||_2 per input feature j (fp64; a stacked expert tensor's per expert and input)."""
        return self.sumsq[self.alias.get(name, name)].sqrt()

    def hessian_of(self, name: str) -> torch.Tensor:
        return self.H[self.alias.get(name, name)]


def gradient_max(
    runner: Runner,
    steps: list[list[Any]],
    views: list[ShardView],
    dtype: torch.dtype,
    stats: InputStats | None = None,
    ledger: Ledger | None = None,
    tag: str = "G",
    sumsq: dict[str, torch.Tensor] | None = None,
    signed: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One pass of fwd+bwd over the calibration steps; per view, max_t |grad_t| of its shard.

    One backward per step serves every view passed in, whatever their number. `sumsq`, when
    given, is filled with sum_t grad_t^2 (fp32) from the same backwards: the gradient-informed
    base scores cost no pass of their own; `signed` likewise with sum_t grad_t (fp32), the
    calibration set's gradient, for the saliency decision.
    """
    out: dict[str, torch.Tensor] = {}
    runner.zero_grad()
    with stats if stats is not None else contextlib.nullcontext():
        for step in steps:
            runner.forward_backward(step, views)
            for v in views:
                grad = v.grad()
                g = grad.abs().to(dtype)
                out[v.name] = g if v.name not in out else torch.maximum(out[v.name], g)
                if sumsq is not None or signed is not None:
                    g32 = grad.float()
                    if sumsq is not None:
                        sumsq[v.name] = g32.square() if v.name not in sumsq else sumsq[v.name].add_(g32.square())
                    if signed is not None:
                        signed[v.name] = g32.clone() if v.name not in signed else signed[v.name].add_(g32)
            runner.zero_grad()
    if ledger is not None:
        ledger.drop("prefix")
        ledger.add("prefix", runner.prefix.nbytes)
        for name, t in out.items():
            ledger.add(f"{tag}/{name}", t)
        for name, t in (sumsq or {}).items():
            ledger.add(f"{tag}/sumsq/{name}", t)
        for name, t in (signed or {}).items():
            ledger.add(f"{tag}/signed/{name}", t)
    return out


def forward_pass(runner: Runner, batches: list[Any], stats: InputStats) -> None:
    """One forward-only pass over the calibration micro-batches with `stats` hooked in."""
    with stats:
        for batch in batches:
            runner.forward(batch)


def default_group_size(views: list[ShardView], units: list[int], comm: Collectives, device: torch.device) -> int:
    """GradProbe's largest K whose heaviest group of K consecutive units fits MEMORY_FRACTION of
    the free memory (min over ranks, so every rank runs the same groups). The methods that hold
    Hessians go one block at a time (`blockwise`) and read no K."""
    cost = {u: 0 for u in units}
    for v in views:
        cost[v.target.unit] += v.local_numel * PROBE_BYTES_PER_ELEMENT
    budget = available_bytes(device) * MEMORY_FRACTION
    seq = [cost[u] for u in units]
    k = 1
    for size in range(1, len(seq) + 1):
        heaviest = max(sum(seq[i : i + size]) for i in range(0, len(seq), size))
        if heaviest <= budget:
            k = size
    return comm.all_reduce_min_int(k)


def calibration_samples(pool: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """`n` sequences drawn without replacement from `pool` [N, T] by `seed` (same on every rank).

    The pool must be the calibration split: the evaluation split never enters it.
    """
    if n > pool.shape[0]:
        raise ValueError(f"calib_samples={n} but the calibration split has {pool.shape[0]} sequences")
    g = torch.Generator().manual_seed(seed)
    return pool[torch.randperm(pool.shape[0], generator=g)[:n]]


def shard_calibration(samples: torch.Tensor, micro_batch: int, grad_accum: int, comm: Collectives) -> list[torch.Tensor]:
    """This rank's calibration micro-batches, laid out so that every (world, accum) pair with
    the same world x accum puts the same global micro-batches in the same probe step.

    Global micro-batch j is samples[j*mb:(j+1)*mb]; probe step t holds global micro-batches
    t*W*A .. (t+1)*W*A - 1; rank r's i-th micro-batch in step t is t*W*A + i*W + r. A tail
    that does not fill a whole probe step is dropped (logged by the caller via the count).
    """
    per_step = micro_batch * grad_accum * comm.world
    steps = samples.shape[0] // per_step
    if steps == 0:
        raise ValueError(f"{samples.shape[0]} calibration samples cannot fill one probe step of {per_step}")
    out = []
    for t in range(steps):
        for i in range(grad_accum):
            j = t * comm.world * grad_accum + i * comm.world + comm.rank
            out.append(samples[j * micro_batch : (j + 1) * micro_batch])
    return out
