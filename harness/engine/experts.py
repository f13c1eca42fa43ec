"""Expert parallelism in the torch engines: the experts split when the model is loaded, and their
gradients reduced and measured apart from the rest.

`split_for(model, layout, device_type)` applies the model's expert plan (`harness.models.experts`,
transformers' own) on the meta model, before any weight is allocated, over the layout's expert mesh
(`ParallelLayout.expert_mesh`); the filled model then holds, on each rank, only its range of every
MoE layer's experts (a `Shard(0)` DTensor, which the checkpoint's DCP saves and reshards like
FSDP2's). DDP is told to leave those tensors alone (neither broadcast at the wrap nor averaged
over the world: each rank's are different experts). FSDP2 shards each experts module over its
replica group instead (`harness.engine.parallelize.fsdp_wrap`, torchtitan's layout for expert
parallelism): a rank stores 1/world of the experts, their range's rows split over the ranks that
hold that range, gathered for the forward in FSDP2's mixed precision (bf16 compute over fp32
shards, as the rest), the gradients reduce-scattered over the replicas.

`ExpertGradients` does what the engine does for the rest, for the experts: after the last
micro-batch's backward, each expert gradient is summed over its replica group (the ranks holding
the same experts; none at expert = world) and divided by the world, the engines' mean (under FSDP2
its reduce-scatter does both in the backward, `gradient_divide_factor`). That is the world-1
gradient: rank r's expert e already holds the gradient of every token of its expert group
routed to e (the all-to-all's backward brought them), and the loss of each rank is its share of the
global mean, as for the parameters the engine averages. The gradient norm is the world-1 norm: the
rest's (identical on every rank after DDP; FSDP2's shards summed over the world) and the experts'
squares summed over the expert group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from harness.config import ParallelLayout
from harness.distributed import local_tensor
from harness.models import clean_name, split_experts


class ExpertGradients:
    """The split experts of one model: their gradients' reduction and their share of the norm."""

    def __init__(self, names: list[str], layout: ParallelLayout, mesh: object):
        self.names = names
        self.params: list[nn.Parameter] = []
        self._ids: set[int] = set()
        self.world = layout.world
        self.replicas = layout.expert_replicas
        self.replica_mesh = mesh["expert_replica"]
        self.replica_group = mesh.get_group("expert_replica")
        self.expert_group = mesh.get_group("expert")
        self.sharded = False  # FSDP2 shards them over the replicas and reduces their gradients (`fsdp_wrap`)

    def bind(self, model: nn.Module) -> ExpertGradients:
        """Take the model's expert parameters as the engine trains them (allocated and filled: the
        meta model's tensors were replaced), by their names before any wrapper (`clean_name`)."""
        params = {clean_name(n): p for n, p in model.named_parameters()}
        self.params = [params[name] for name in self.names]
        self._ids = {id(p) for p in self.params}
        return self

    def modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules holding the split experts, each holding nothing else (one FSDP2 group each:
        their shards live on the replica mesh, the rest on the world's)."""
        modules = {clean_name(n): m for n, m in model.named_modules()}
        owners = list(dict.fromkeys(name.rpartition(".")[0] for name in self.names))
        for owner in owners:
            others = [f"{owner}.{n}" for n, _ in modules[owner].named_parameters() if f"{owner}.{n}" not in self.names]
            if others:
                raise ValueError(f"{owner} holds {others[0]} beside its split experts: FSDP2 cannot shard it with them")
        return [modules[owner] for owner in owners]

    def is_expert(self, p: torch.Tensor) -> bool:
        return id(p) in self._ids

    def local_bytes(self) -> int:
        """What this rank stores of the experts (the proof of the split: 1/expert of the whole)."""
        return sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in self.params)

    @torch.no_grad()
    def reduce(self) -> None:
        """Each expert gradient: summed over its replica group, divided by the world (under FSDP2,
        done by its reduce-scatter)."""
        if self.sharded:
            return
        for p in self.params:
            if p.grad is None:
                continue
            g = local_tensor(p.grad)
            if self.replicas > 1:
                dist.all_reduce(g, group=self.replica_group)
            g.div_(self.world)

    @torch.no_grad()
    def clip(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """`clip_grad_norm_` over `params` (experts among them): the total norm, every rank the same,
        and each gradient scaled by torch's coefficient."""
        rest = [p.grad for p in params if not self.is_expert(p)]
        mine = [local_tensor(p.grad) for p in params if self.is_expert(p)]
        device = (rest or mine)[0].device
        zero = torch.zeros((), device=device)
        rest_sq = torch.nn.utils.get_total_norm(rest).square() if rest else zero
        rest_sq = rest_sq.full_tensor() if isinstance(rest_sq, DTensor) else rest_sq  # FSDP2's shards: the norm over all
        experts_sq = torch.stack([g.float().square().sum() for g in mine]).sum() if mine else zero.clone()
        # each rank's part: its range's (an expert group holds every expert once), or under FSDP2 its
        # shard of that range (the whole world holds every expert once)
        dist.all_reduce(experts_sq, group=None if self.sharded else self.expert_group)
        total = (rest_sq + experts_sq).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in [*rest, *mine]:
            g.mul_(coef.to(g.dtype))
        return total


def split_for(model: nn.Module, layout: ParallelLayout, device_type: str) -> ExpertGradients:
    """Split the meta model's experts over the layout's expert mesh; the gradients' keeper."""
    mesh = layout.expert_mesh(device_type)
    names = split_experts(model, mesh["expert"], mesh["same_batch"])
    return ExpertGradients(names, layout, mesh)
