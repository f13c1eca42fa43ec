"""Expert parallelism inside an HF MoE model: transformers' own expert plan, applied as it ships.

transformers 5 describes how a MoE family splits its experts in the model's config
(`base_model_ep_plan`, gathered with the children's by `model.ep_plan`): the stacked expert
tensors (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) are `grouped_gemm`, a `Shard(0)`
DTensor over the expert mesh (each rank its consecutive range of experts, the module's
`num_experts` set to the local count), and the experts module is `ep_dispatch_experts`: its
forward sorts each (token, expert) pair by owner, exchanges them with `all_to_all_single`
(autograd's, so the backward sends the gradients back the same way; gloo runs it), runs the
local experts and returns the weighted outputs to the ranks that sent the tokens. harness calls
`apply_expert_parallelism` with that plan, its `*` replaced by the layer numbers by the model's
own `_expand_parallel_plan`, on the meta model before any weight is allocated; nothing of the
dispatch is harness's. Families with such a plan in transformers 5.24 include Qwen3-MoE, Mixtral,
OLMoE and gpt-oss; a model without one is refused (`expert_parallel_problem`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

EXPERT_STYLE = "grouped_gemm"  # the plan's style for a stacked expert tensor (dim 0: the experts)


def expert_plan(model: nn.Module) -> dict[str, str]:
    """The model's expert plan, one entry per parameter and module ({} when it has none)."""
    plan = getattr(model, "ep_plan", None)
    if not plan:
        return {}
    return model._expand_parallel_plan(plan)


def expert_tensors(model: nn.Module) -> dict[str, nn.Parameter]:
    """The stacked expert parameters the plan splits, by name."""
    params = dict(model.named_parameters())
    return {name: params[name] for name, style in expert_plan(model).items() if style == EXPERT_STYLE and name in params}


def stacked_expert_weights(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, attribute) of every stacked expert weight under `module`: a 3-D
    parameter, one matrix per expert along dim 0 (transformers 5 holds a MoE layer's experts so:
    `experts.gate_up_proj`, `experts.down_proj`; under ZeRO-3 a placeholder whose shape is its
    `ds_shape`). Found by shape, not by the expert plan (`expert_tensors`): a family without a plan
    has stacked experts all the same. Expert biases are 2-D and are not among them. Names are as
    `named_modules` gives them (wrappers included): the caller cleans them for its own use."""
    return [
        (name, m, attr)
        for name, m in module.named_modules()
        for attr, p in m.named_parameters(recurse=False)
        if len(getattr(p, "ds_shape", p.shape)) == 3
    ]


def expert_count(model: nn.Module) -> int | None:
    """How many experts each MoE layer has (dim 0 of its stacked tensors); None without an expert plan."""
    counts = {p.shape[0] for p in expert_tensors(model).values()}
    return counts.pop() if len(counts) == 1 else None


def expert_parallel_problem(model: nn.Module, n: int) -> str | None:
    """Why `parallel.expert=n` cannot split this model's experts (None: it can)."""
    name = type(model).__name__
    count = expert_count(model)
    if count is None:
        return (
            f"parallel.expert={n}: {name} has no expert plan in transformers (no mixture-of-experts layers with a "
            "base_model_ep_plan); set parallel.expert=1"
        )
    if count % n:
        return f"parallel.expert={n} must divide the model's {count} experts per layer: each rank holds an equal share"
    return None


def split_experts(model: nn.Module, expert_mesh: DeviceMesh, same_batch_mesh: DeviceMesh) -> list[str]:
    """Apply the model's expert plan over `expert_mesh` (the ranks that split one copy of the
    experts); `same_batch_mesh`: the ranks holding the same batch (transformers' `tp_mesh`: each
    rank alone here, every rank reads its own samples). Returns the split parameters' names."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = expert_plan(model)
    names = list(expert_tensors(model))
    if not names:  # the plan would apply to nothing and every rank keep every expert, silently
        raise ValueError(
            f"{type(model).__name__}: its expert plan names none of its parameters (a wrapper, such as peft's, renamed "
            "them): no expert would be split"
        )
    apply_expert_parallelism(model, expert_mesh, same_batch_mesh, plan)
    return names


# The attributes by which transformers' MoE modules name their expert count (router and experts alike).
EXPERT_COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts")


def declares_experts(module: nn.Module, count: int) -> bool:
    """Whether `module` names `count` as its expert count (a router or an experts module of that layer)."""
    return any(getattr(module, a, None) == count for a in EXPERT_COUNT_ATTRS)


def drop_experts(model: nn.Module, kept: dict[str, list[int]]) -> int:
    """Remove every expert not in `kept` (MoE block name -> the expert indices it keeps, every block
    the same number), in place: the block's router rows and its experts' stacked tensors (and any
    parameter or buffer of theirs indexed by expert), their expert counts, and the config's, so
    `save_pretrained` writes the smaller model transformers builds from its config. The modules
    that index by expert are the block's children whose expert-count attribute equals the old
    count (a shared expert has none and is kept whole). Returns the new count per block."""
    sizes = {len(k) for k in kept.values()}
    if len(sizes) != 1:
        raise ValueError(f"every MoE block must keep the same number of experts (the config holds one count), not {sorted(sizes)}")
    (new,) = sizes
    modules = dict(model.named_modules())
    old = 0
    for block_name, indices in kept.items():
        block = modules[block_name]
        counts = _child_counts(block)
        if len(counts) != 1:
            raise ValueError(f"{block_name}: its children declare expert counts {sorted(counts)}, not one")
        old = counts.pop()
        parts = [m for m in block.children() if declares_experts(m, old)]
        index = torch.tensor(sorted(indices), dtype=torch.long)
        for part in parts:
            for name, p in list(part.named_parameters(recurse=False)):
                if p.shape and p.shape[0] == old:
                    setattr(part, name, nn.Parameter(p.data.index_select(0, index.to(p.device)), requires_grad=p.requires_grad))
            for name, b in list(part.named_buffers(recurse=False)):
                if b is not None and b.shape and b.shape[0] == old:
                    part.register_buffer(name, b.index_select(0, index.to(b.device)))
            for a in EXPERT_COUNT_ATTRS:
                if getattr(part, a, None) == old:
                    setattr(part, a, new)
    for owner in (model, model.config, getattr(model.config, "text_config", None)):
        for a in EXPERT_COUNT_ATTRS:
            if owner is not None and getattr(owner, a, None) == old:
                setattr(owner, a, new)
    return new


def _child_counts(block: nn.Module) -> set[int]:
    """The expert counts a MoE block's children declare."""
    return {v for m in block.children() for a in EXPERT_COUNT_ATTRS if isinstance(v := getattr(m, a, None), int)}
