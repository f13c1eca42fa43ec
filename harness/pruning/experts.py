"""Expert pruning: drop each mixture-of-experts layer's least useful experts, at any world size.

`prune.experts` is the fraction of every MoE layer's experts to drop (the same number in each
layer, as a config holds one expert count); `prune.expert_score` says how usefulness is measured
on the calibration set, each expert's score summed over every rank's tokens so any world size
picks the same experts:

  gradient   (the default, measured best: notes/expert_pruning.md) the probe's estimate of the
             loss change of removing the expert (Molchanov et al. 2019's Taylor criterion): the
             sum over its (token, slot) pairs of (w * dL/dw)^2, w the routing weight the experts
             module applies. The MoE output is linear in w (sum_k w_k f_k(x)), so dL/dw of a pair
             is <dL/dy, f_k(x)> exactly, read from one backward per probe step with a hook on w.
             Squared, because the signed first-order sum -w * dL/dw cancels over tokens at a
             trained model (measured: it chose worse than random); its square is the
             second-order term with the gradient's outer product for the Hessian. The experts
             whose removal costs least go.
  reap       REAP (router-weighted expert activation pruning, Lasby et al. 2025, eq. 9), as its
             authors' code computes it: the mean, over the tokens routed to the expert, of its
             router probability (the softmax of the router's logits over all experts, whatever
             the family then combines) times the L2 norm of its output; the experts whose
             weighted output is smallest where they are used go. How often an expert is used
             does not enter.
  frequency  the tokens routed to the expert (the least used go): the usual baseline.
  random     a seeded draw (prune.calib_seed): the floor every rule must beat.

Masking. A dropped expert's router logit becomes -inf: the router runs as the smaller model's
would (its rows of the kept experts, its count of them) and its indices are mapped back to the
full model's, so every rule of the family's routing (softmax then top-k, normalised or not, or
top-k then softmax) sees exactly the smaller model's numbers. The export (`drop_experts`)
writes that smaller model; the two give the same logits. A router whose output is not
(logits, ..., indices) is refused in one line.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from harness.config import PruneConfig
from harness.distributed import Collectives
from harness.errors import ConfigError
from harness.models import EXPERT_COUNT_ATTRS, clean_name, declares_experts, stacked_expert_weights
from harness.pruning.calibration import Runner
from harness.training import base_model, model_class, router_class


@dataclass
class MoELayer:
    """One mixture-of-experts block of the model."""

    block: str  # the block's module name, wrappers' names removed: what the export keys by
    router: nn.Module
    experts: nn.Module  # the module that runs the experts: (hidden, indices, weights) -> weighted sum
    count: int


def moe_layers(model: Any) -> list[MoELayer]:
    """The model's MoE blocks in forward order (empty for a model without a router transformers records)."""
    hf = base_model(model)
    target = router_class(hf)
    if target is None:
        return []
    modules = dict(hf.named_modules())
    out = []
    for name, router in modules.items():
        if not isinstance(router, target):
            continue
        count = next((v for a in EXPERT_COUNT_ATTRS if isinstance(v := getattr(router, a, None), int)), None)
        parent = name.rpartition(".")[0]
        runners = [m for m in modules[parent].children() if m is not router and count is not None and declares_experts(m, count)]
        if count is None or len(runners) != 1:
            raise ConfigError(f"prune.experts: {type(router).__name__} at {name} has no one experts module beside it to prune")
        out.append(MoELayer(clean_name(parent), router, runners[0], count))
    return out


def _call_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden, indices, weights) of an experts module's call, positional or by keyword."""
    values = list(args) + list(kwargs.values())
    if len(values) != 3:
        raise ConfigError(f"prune.experts: an experts module was called with {len(values)} inputs, not (hidden, indices, weights)")
    return values[0], values[1], values[2]


class ExpertScores:
    """Each layer's per-expert sums over this rank's calibration tokens, from hooks on the experts
    modules: `count` (tokens routed) and `value` (the rule's numerator)."""

    def __init__(self, layers: list[MoELayer], rule: str) -> None:
        self.layers, self.rule = layers, rule
        device = next(layers[0].experts.parameters()).device
        self.count = torch.zeros(len(layers), layers[0].count, dtype=torch.float64, device=device)
        self.value = torch.zeros_like(self.count)
        self._logits: dict[int, torch.Tensor] = {}  # each layer's last router logits (REAP's probabilities)
        self._handles: list[Any] = []

    def __enter__(self) -> ExpertScores:
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.experts.register_forward_pre_hook(self._experts_hook(i), with_kwargs=True))
            if self.rule == "reap":
                self._handles.append(layer.router.register_forward_hook(self._logits_hook(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _logits_hook(self, i: int) -> Callable[..., None]:
        def hook(router: nn.Module, args: Any, output: Any) -> None:
            self._logits[i] = output[0].detach()

        return hook

    def _experts_hook(self, i: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden, index, weight = _call_args(args, kwargs)
            flat = index.reshape(-1)
            self.count[i].index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
            if self.rule == "reap":
                with torch.no_grad():
                    probs = torch.softmax(self._logits.pop(i).double().reshape(index.shape[0], -1), dim=-1)
                    for k in range(index.shape[-1]):  # one slot at a time: each token's k-th expert's own output
                        out = module.forward(hidden, index[:, k : k + 1], torch.ones_like(weight[:, k : k + 1]))
                        contrib = probs.gather(1, index[:, k : k + 1]).squeeze(1) * out.detach().double().norm(dim=-1)
                        self.value[i].index_add_(0, index[:, k], contrib)
            elif self.rule == "gradient" and torch.is_grad_enabled():
                probe = weight.view_as(weight) if weight.requires_grad else weight.detach().requires_grad_()
                probe.register_hook(self._gradient_hook(i, index, probe.detach()))
                return (hidden, index, probe), {}
            return None

        return hook

    def _gradient_hook(self, i: int, index: torch.Tensor, weight: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            change = weight.double() * grad.double()  # each (token, slot): first order, the loss change of removing its term
            self.value[i].index_add_(0, index.reshape(-1), change.square().reshape(-1))

        return hook

    def totals(self, comm: Collectives, seed: int) -> torch.Tensor:
        """[layer, expert] scores over every rank's tokens (higher: more useful): the same at any world
        size for the same global calibration batches (a probe step's loss is divided by its
        accumulation, as training's is)."""
        count = comm.all_reduce_sum(self.count.clone())
        value = comm.all_reduce_sum(self.value.clone())
        if self.rule == "reap":
            return torch.where(count > 0, value / count.clamp(min=1), torch.zeros_like(value))
        if self.rule == "frequency":
            return count
        if self.rule == "random":
            return torch.rand(count.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(count.device)
        return value / comm.world**2  # each rank's gradient is of its own loss: the engines' loss is their mean over ranks


def routing_problem(router: nn.Module, output: Any, count: int) -> str | None:
    """Why a router's output cannot be masked as the smaller model's (None: it can): harness needs
    (logits over the experts, ..., the chosen indices)."""
    ok = (
        isinstance(output, tuple)
        and all(isinstance(o, torch.Tensor) for o in output)
        and output[0].is_floating_point()
        and output[0].shape[-1] == count
        and any(not o.is_floating_point() for o in output[1:])
    )
    if ok:
        return None
    return (
        f"prune.experts: {model_class(router).__name__} returns {type(output).__name__}, not (router logits, ..., expert indices): "
        "harness cannot route it as the smaller model would"
    )


def choose(scores: torch.Tensor, drop: int) -> list[list[int]]:
    """Each layer's kept experts: all but its `drop` lowest scores (ties: the lower index goes first)."""
    kept = []
    for row in scores.cpu():
        order = sorted(range(row.numel()), key=lambda e: (float(row[e]), e))
        kept.append(sorted(order[drop:]))
    return kept


def drop_count(p: PruneConfig, count: int, top_k: int) -> int:
    """How many of `count` experts each layer drops (ConfigError where that leaves none to drop or too few to route)."""
    drop = int(p.experts * count + 1e-9)
    if drop < 1:
        raise ConfigError(f"prune.experts={p.experts:g} drops none of {count} experts per layer; set it to at least {1 / count:g}")
    if count - drop < top_k:
        raise ConfigError(
            f"prune.experts={p.experts:g} keeps {count - drop} of {count} experts per layer, fewer than the model routes each "
            f"token to ({top_k}); set it to at most {(count - top_k) / count:g}"
        )
    return drop


def experts_to_drop(model: nn.Module, p: PruneConfig) -> tuple[list[MoELayer], int]:
    """The model's MoE layers and how many experts each drops; ConfigError for a model without
    them or a fraction that leaves none to drop or too few to route (pre-flight asks on the meta model)."""
    layers = moe_layers(model)
    if not layers:
        name = model_class(base_model(model)).__name__
        if stacked_expert_weights(model):  # experts, but no router transformers records (Llama 4's)
            raise ConfigError(
                f"prune.experts={p.experts:g}: {name}'s routers are not among the outputs transformers records (router_logits), "
                "so harness cannot score its experts or route around them; unset it"
            )
        raise ConfigError(f"prune.experts={p.experts:g}: {name} has no mixture-of-experts layers; unset it")
    return layers, drop_count(p, layers[0].count, int(getattr(layers[0].router, "top_k", 1)))


class RouterMask:
    """Routes as the smaller model: a forward hook on each router (placed before any other, so a
    sharded engine's release and transformers' recording see the masked output)."""

    def __init__(self, layers: list[MoELayer], kept: list[list[int]]) -> None:
        self._handles = [
            layer.router.register_forward_hook(self._hook(layer.count, torch.tensor(k)), prepend=True) for layer, k in zip(layers, kept)
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @staticmethod
    def _hook(count: int, kept: torch.Tensor) -> Callable[..., Any]:
        def hook(router: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if (problem := routing_problem(router, output, count)) is not None:
                raise ConfigError(problem)
            index = kept.to(output[0].device)
            smaller = copy.copy(router)
            object.__setattr__(smaller, "_parameters", {n: _rows(p, count, index) for n, p in router._parameters.items()})
            object.__setattr__(smaller, "_buffers", {n: _rows(b, count, index) for n, b in router._buffers.items()})
            for a in EXPERT_COUNT_ATTRS:
                if getattr(router, a, None) == count:
                    object.__setattr__(smaller, a, index.numel())
            try:
                out = model_class(router).forward(smaller, *args)
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # a rule of the family's routing that a smaller count breaks
                raise ConfigError(
                    f"prune.experts: {model_class(router).__name__} cannot route over {index.numel()} of its {count} experts "
                    f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]})"
                ) from None
            if out[0].shape[-1] != index.numel():
                raise ConfigError(
                    f"prune.experts: {model_class(router).__name__} computes its logits from more than its own rows of experts"
                )
            logits = out[0].new_full((*out[0].shape[:-1], count), float("-inf"))
            logits[..., index] = out[0]
            return (logits, *(o if o.is_floating_point() else index[o] for o in out[1:]))

        return hook


def _rows(t: torch.Tensor | None, count: int, index: torch.Tensor) -> torch.Tensor | None:
    return t.index_select(0, index) if t is not None and t.dim() and t.shape[0] == count else t


@dataclass
class ExpertReport:
    """What expert pruning did: `kept` is what the masks route to and what the export keeps."""

    score: str
    fraction: float
    count: int  # experts per layer before
    kept: dict[str, list[int]]  # MoE block -> its kept experts
    scores: dict[str, list[float]]  # MoE block -> every expert's score (the rule's units)
    tokens: dict[str, list[int]]  # MoE block -> tokens routed to each expert over the calibration set
    wall_time_s: float
    fwd_passes: float = 0.0
    fwd_bwd_passes: float = 0.0
    mask: RouterMask | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "mask"}
        out["kept_per_layer"] = len(next(iter(self.kept.values())))
        return out

    def summary(self) -> str:
        kept = len(next(iter(self.kept.values())))
        return (
            f"pruned experts by {self.score}: {kept} of {self.count} kept in each of {len(self.kept)} MoE layers, "
            f"{self.wall_time_s:.2f}s, passes fwd {self.fwd_passes:g} fwd+bwd {self.fwd_bwd_passes:g}"
        )


def prune_experts(
    model_or_engine: Any,
    batches: list[Any],
    cfg: PruneConfig,
    loss_fn: Any,
    *,
    comm: Collectives | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> ExpertReport:
    """Score every MoE layer's experts on this rank's calibration `batches` by `cfg.expert_score`,
    drop `cfg.experts` of each and route around them (`RouterMask`, installed on return). Collective."""
    comm = comm or Collectives()
    t0 = time.perf_counter()
    runner = Runner(model_or_engine, loss_fn, comm=comm, should_stop=should_stop)
    layers, drop = experts_to_drop(runner.module, cfg)
    with runner.eval_mode(), torch.no_grad():  # the routers can route as the smaller model: said before any scoring
        trial = RouterMask(layers, [list(range(layer.count - drop)) for layer in layers])
        try:
            loss_fn(model_or_engine, batches[0])
        finally:
            trial.remove()
    scores = ExpertScores(layers, cfg.expert_score)
    with runner.eval_mode(), scores:
        if cfg.expert_score == "gradient":
            for step in runner.steps(batches):
                runner.forward_backward(step)
                runner.zero_grad()
        else:
            for batch in batches:
                runner.forward(batch)
    totals = scores.totals(comm, cfg.calib_seed)
    tokens = comm.all_reduce_sum(scores.count.clone())
    kept = choose(totals, drop)
    n = max(1, len(batches))
    report = ExpertReport(
        score=cfg.expert_score,
        fraction=cfg.experts,
        count=layers[0].count,
        kept={layer.block: k for layer, k in zip(layers, kept)},
        scores={layer.block: [float(v) for v in row] for layer, row in zip(layers, totals.cpu())},
        tokens={layer.block: [int(v) for v in row] for layer, row in zip(layers, tokens.cpu())},
        wall_time_s=time.perf_counter() - t0,
        fwd_passes=runner.fwd_batches / n,
        fwd_bwd_passes=runner.fwd_bwd_batches / n,
    )
    report.mask = RouterMask(layers, kept)
    return report
