"""A mixture-of-experts router's load-balancing loss, as transformers defines it for the family, and
each layer's expert load.

transformers computes the loss in the family's modeling module (`load_balancing_loss_func`: Switch
Transformer's E * sum_e f_e * P_e over one forward's tokens, f_e the fraction of top-k assignments
that go to expert e, P_e expert e's mean router probability) and adds `router_aux_loss_coef` times
it to the loss only when `output_router_logits` is set, which the families' configs leave off: a
model trained through harness's own fp32 loss (`harness.training.loss`) would train without it and
say nothing. `RouterLoss` asks the model for its router logits (transformers records them from the
router modules its `_can_record_outputs` names), calls the family's own function on them, and adds
coefficient x loss to every training micro-batch's loss; evaluation (no gradient) asks for none.

Weighting. The loss is per micro-batch (transformers' definition: the balance of one forward's
tokens), and the engines average the micro-batch losses over accumulation and ranks, so the step's
aux term is the mean over its micro-batches and ranks. Every micro-batch routes the same number of
tokens (micro_batch_size x seq_len; padding is routed too, as transformers routes it without an
attention mask), so that mean is also the mean weighted by routed tokens; weighting by labelled
tokens, as the language-model loss is, would weigh a router's balance by how many of its tokens
carry labels, which routing does not see. The same micro-batches spread differently over ranks
and accumulation (world 2 x accum 1, world 1 x accum 2: the sampler gives each (micro-batch, rank)
position the same blocks) give the same loss and gradients; another micro_batch_size changes what
one micro-batch balances, and so the loss, as in transformers. Under sequence parallelism a rank
holds a slice of its micro-batch's sequences: its router logits are gathered over the sequence
group and every rank computes the whole micro-batch's loss (`whole_sequences`), the value and the
gradients of one process (the slice's own balance, used until 2026-12-07, is another loss: the
product of two means over tokens does not split over slices).

Logged per step (`pop`, summed over ranks in the step guard's one sync; `step_metrics`):
train/aux_loss, the loss without its coefficient (transformers' `aux_loss`), also where the
coefficient is 0; and per router layer `moe/expert_load/layer_<i>`, the step's most loaded expert's
tokens over the mean tokens per expert (1: balanced; E/top_k: every token to the same top_k).
"""

from __future__ import annotations

import collections
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.distributed import gather_rows, unwrap
from harness.errors import ConfigError

AUX_LOSS = "train/aux_loss"
EXPERT_LOAD = "moe/expert_load/layer_"  # + the layer's index
_ARGS = ["gate_logits", "num_experts", "top_k", "attention_mask"]  # the families' common signature


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside any wrapper (DDP, DeepSpeed, compile) and peft's LoRA model."""
    inner = unwrap(model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) else inner


def model_class(model: nn.Module) -> type:
    """The transformers class of `model` (FSDP2 makes each sharded module an instance of a class of its own)."""
    return next((c for c in type(model).__mro__ if not c.__module__.startswith("torch.")), type(model))


def router_class(model: nn.Module) -> type | None:
    """The module class transformers records `router_logits` from (`_can_record_outputs`); None: no router."""
    spec = (getattr(model_class(base_model(model)), "_can_record_outputs", None) or {}).get("router_logits")
    spec = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    target = getattr(spec, "target_class", spec)
    return target if isinstance(target, type) else None


def _family(model: nn.Module) -> Any:
    return sys.modules.get(model_class(model).__module__)


def unexposed(model: nn.Module) -> str | None:
    """Why transformers gives harness no load-balancing loss for this model's router (None: it does)."""
    hf = base_model(model)
    fn = getattr(_family(hf), "load_balancing_loss_func", None)
    cls = model_class(hf)
    name = cls.__name__
    if fn is None:
        return f"transformers' {cls.__module__} defines no load_balancing_loss_func for {name}'s router"
    if list(inspect.signature(fn).parameters)[:4] != _ARGS:
        return f"{name}'s load_balancing_loss_func takes ({', '.join(inspect.signature(fn).parameters)}), not ({', '.join(_ARGS)})"
    if not all(isinstance(getattr(hf, a, None), int) for a in ("num_experts", "num_experts_per_tok")):
        return f"{name} does not say its num_experts and num_experts_per_tok"
    if "output_router_logits" not in inspect.signature(hf.forward).parameters:
        return f"{name}'s forward takes no output_router_logits"
    return None


def router_refusal(model: nn.Module, written: float | None) -> str | None:
    """The one-line refusal of a coefficient written (`moe.aux_loss_coef` > 0) for a model without a
    router transformers exposes; None when there is nothing to refuse."""
    if not written:
        return None
    if router_class(model) is None:
        return (
            f"moe.aux_loss_coef={written:g} but {model_class(base_model(model)).__name__} has no mixture-of-experts router; unset it (auto)"
        )
    problem = unexposed(model)
    return None if problem is None else f"moe.aux_loss_coef={written:g}: {problem}; unset it (auto) to train without the loss"


def whole_sequences(
    logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None, group: dist.ProcessGroup
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """Every layer's router logits (and the mask) of the whole sequences, from each rank's slice of
    them: gathered over the sequence group with torch's autograd all-gather, slices in rank order
    (the family's loss takes means over tokens, in whatever order, each token's mask entry beside it).
    Every rank of the group then computes the same loss; the gather's backward sums the ranks'
    gradients of each slice, so the group's gradient is the group's size times one loss's, which
    the engines' mean over the world makes the mean over data-parallel ranks, as for the rest."""
    whole = tuple(gather_rows(layer, group) for layer in logits)
    if attention_mask is None:
        return whole, None
    masks = [torch.empty_like(attention_mask) for _ in range(dist.get_world_size(group))]
    dist.all_gather(masks, attention_mask.contiguous(), group=group)
    return whole, torch.cat(masks)  # (ranks x batch, slice): the logits' order


def _layer_index(name: str, position: int) -> int:
    found = re.findall(r"\.(\d+)(?:\.|$)", f".{name}")
    return int(found[-1]) if found else position


def join_token_tiles(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], rows: int) -> torch.Tensor:
    """Sequence tiles of `rows` rows' flattened tokens, each `(rows x tile, ...)`, as the untiled
    `(rows x positions, ...)`: row after row, each row's positions in order."""
    return torch.cat([p.reshape(rows, -1, *p.shape[1:]) for p in parts], dim=1).reshape(-1, *parts[0].shape[1:])


def per_layer(logits: tuple[torch.Tensor, ...], layers: int, rows: int | None) -> tuple[torch.Tensor, ...]:
    """One `[tokens, experts]` tensor per layer. transformers records a router's logits once per
    call, and the tiled MLP (`harness.memory.tiled_mlp`) calls each layer's router once per sequence
    tile, a layer's tiles in turn: they are joined back in (row, position) order, the order of the
    attention mask's `rows` x positions (without a mask the order changes nothing: the balance and
    the expert counts are sums over tokens)."""
    if len(logits) == layers or not layers:
        return logits
    tiles, rest = divmod(len(logits), layers)
    assert not rest, (len(logits), layers)
    return tuple(join_token_tiles(logits[layer * tiles : (layer + 1) * tiles], rows or 1) for layer in range(layers))


class RouterLoss:
    """The loss functions' router term (`harness.training.loss`'s `router`): built from
    `moe.aux_loss_coef` read (`harness.config.aux_loss_coefficient`: None for auto), inactive until
    `attach` has seen the built model."""

    def __init__(self, written: float | None) -> None:
        self.written = written
        self.sequence_group: dist.ProcessGroup | None = None  # ranks holding slices of the same sequences (`attach`)
        self.coef = 0.0  # what multiplies the loss (0: logged, not added)
        self.active = False  # the model exposes its router: ask for its logits in training forwards
        self.layers: list[int] = []  # each router's decoder layer, in forward order
        self.num_experts = self.top_k = 0
        self._loss_func: Callable[..., Any] | None = None
        self._sum: torch.Tensor | None = None  # [aux, counts of layer 0, ...] summed since `pop`
        # `(B, S)`: which tokens the run routed (False: the padding of an unpacked row), one per forward
        # to come, in forward order (a step's micro-batches are dealt before the first forward): the
        # check's reference, whose rows hold the run's packed examples one to a row; empty: every token
        self.routed_tokens: collections.deque[torch.Tensor] = collections.deque()

    def attach(self, model: nn.Module, sequence_group: dist.ProcessGroup | None = None) -> str | None:
        """Resolve the coefficient from the built model (its family, its config, whether a router
        trains); ConfigError for a coefficient written where transformers exposes no loss. Returns
        what the start-up line says of it (None for a model without a router). `sequence_group`:
        under sequence parallelism, the ranks whose slices make up this rank's sequences (the loss
        is then the whole sequences' balance, `__call__`)."""
        self.sequence_group = sequence_group
        if (refusal := router_refusal(model, self.written)) is not None:
            raise ConfigError(refusal)
        target = router_class(model)
        if target is None:
            return None
        hf = base_model(model)
        if (problem := unexposed(model)) is not None:
            return f"no router aux loss ({problem}; no expert-load metrics)"
        routers = [(n, m) for n, m in hf.named_modules() if isinstance(m, target)]
        self.layers = [_layer_index(n, i) for i, (n, _) in enumerate(routers)]
        self.num_experts, self.top_k = hf.num_experts, hf.num_experts_per_tok
        self._loss_func = _family(hf).load_balancing_loss_func
        self.active = True
        config_coef = float(getattr(hf.config, "router_aux_loss_coef", 0.0) or 0.0)
        if self.written is not None:
            self.coef = self.written
            why = "moe.aux_loss_coef=0; logged, not added" if not self.coef else f"moe.aux_loss_coef; the model config's {config_coef:g}"
        elif not any(p.requires_grad for _, m in routers for p in m.parameters()):
            why = "the routers do not train: a frozen base; moe.aux_loss_coef=<number> adds it anyway"
        else:
            self.coef = config_coef
            why = "the model config's router_aux_loss_coef" + ("; moe.aux_loss_coef=0 turns it off" if config_coef else " is 0")
        state = f"x{self.coef:g}" if self.coef else "off"
        return f"router aux loss {state} ({why}), {len(routers)} routers of {self.num_experts} experts top-{self.top_k}"

    def __call__(self, router_logits: Any, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """This micro-batch's term to add to its loss (coefficient x the family's loss; None where the
        coefficient is 0), its loss and expert counts recorded for `pop`."""
        if self.routed_tokens:  # the padding is not the run's: a mask the families' functions weight by
            attention_mask = self.routed_tokens.popleft().float()
        logits = per_layer(tuple(router_logits), len(self.layers), None if attention_mask is None else attention_mask.shape[0])
        assert self._loss_func is not None and len(logits) == len(self.layers), (len(logits), self.layers)
        if attention_mask is not None:
            attention_mask = attention_mask.to(logits[0].device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.coef > 0):
            gates, mask = logits, attention_mask
            if self.sequence_group is not None:  # the whole sequences' tokens, as one process routes them
                gates, mask = whole_sequences(logits, attention_mask, self.sequence_group)
            aux = self._loss_func(gates, self.num_experts, self.top_k, mask)
        with torch.no_grad():
            counts = torch.zeros(len(logits), self.num_experts, dtype=torch.float64, device=aux.device)
            weight = None if attention_mask is None else attention_mask.reshape(-1, 1).to(aux.device, torch.float64)
            for layer, gate in enumerate(logits):  # this rank's tokens: the ranks' counts are summed
                chosen = torch.topk(gate.to(aux.device), self.top_k, dim=-1).indices
                ones = torch.ones(chosen.shape, dtype=torch.float64, device=aux.device)
                counts[layer].scatter_add_(0, chosen.reshape(-1), (ones if weight is None else ones * weight).reshape(-1))
            record = torch.cat([aux.detach().double().reshape(1), counts.reshape(-1)])
            self._sum = record if self._sum is None else self._sum + record
        return self.coef * aux if self.coef else None

    def pop(self) -> torch.Tensor | None:
        """[aux loss, expert counts] summed over the micro-batches since the last pop, on the device, unread."""
        out, self._sum = self._sum, None
        return out

    def step_metrics(self, summed: tuple[float, ...], micro_batches: int) -> dict[str, float]:
        """train/aux_loss (the mean over the step's `micro_batches`, all ranks') and each layer's
        expert load, from `pop`'s values summed over ranks."""
        if not summed:
            return {}
        out = {AUX_LOSS: summed[0] / micro_batches}
        for i, layer in enumerate(self.layers):
            counts = summed[1 + i * self.num_experts : 1 + (i + 1) * self.num_experts]
            if sum(counts) > 0:
                out[f"{EXPERT_LOAD}{layer}"] = max(counts) * self.num_experts / sum(counts)
        return out


__all__ = ["AUX_LOSS", "EXPERT_LOAD", "RouterLoss", "base_model", "model_class", "router_class", "router_refusal", "unexposed"]
