"""What the planner's formulas know of a model's parameters: their shapes, names and which are experts.

Kept apart from the trace because it is read without one: the untraced bounds of `--recommend`
and of the `--fastest` search (`harness.planner.recommend`), the load phase and the engines'
model-state formulas all take a `ParamInfo` built straight from a fake model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from torch import nn

from harness.distributed import local_tensor
from harness.models import expert_tensors


@dataclass
class ParamInfo:
    """Shape facts of the *unwrapped* model, for the analytic model-state formulas."""

    numels: list[int]  # trainable parameters, in ``model.parameters()`` order
    shapes: list[tuple[int, ...]]
    names: list[str]
    buffer_bytes: int
    hidden_size: int
    num_layers: int
    frozen_shapes: list[tuple[int, ...]] = field(default_factory=list)  # parameters that take no gradient (LoRA's base)
    frozen_names: list[str] = field(default_factory=list)
    expert_names: tuple[str, ...] = ()  # the stacked expert tensors expert parallelism splits (transformers' expert plan)
    split_names: frozenset[str] = frozenset()  # of `names`: the experts split over ranks (FSDP2 shards them over their replicas)

    def split(self, degree: int) -> ParamInfo:
        """What one rank holds with every MoE layer's experts split over ``degree`` ranks (dim 0, evenly),
        without tracing: the model-state bound of a search candidate."""
        if degree == 1 or not self.expert_names:
            return self
        experts = set(self.expert_names)
        shapes = [(s[0] // degree, *s[1:]) if n in experts else s for n, s in zip(self.names, self.shapes)]
        numels = [math.prod(s) for s in shapes]
        return replace(self, numels=numels, shapes=shapes, split_names=frozenset(experts))

    @property
    def split_expert_numel(self) -> int:
        """Of `numels`: this rank's part of the experts split over ranks (DDP leaves them out of its buckets)."""
        return sum(k for n, k in zip(self.names, self.numels) if n in self.split_names)

    @property
    def frozen(self) -> int:
        return sum(math.prod(s) for s in self.frozen_shapes)

    @property
    def whole_largest(self) -> int:
        """The largest parameter, frozen or not (a model is loaded a tensor at a time)."""
        return max([self.largest, *(math.prod(s) for s in self.frozen_shapes)])

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def largest(self) -> int:
        return max(self.numels) if self.numels else 0


def param_info(model: nn.Module) -> ParamInfo:
    """The parameters this rank holds whole: a DTensor's local part (experts split over ranks)."""
    params = [(n, local_tensor(p)) for n, p in model.named_parameters() if p.requires_grad]
    frozen = [(n, local_tensor(p)) for n, p in model.named_parameters() if not p.requires_grad]
    config = getattr(model, "config", None)
    return ParamInfo(
        numels=[p.numel() for _, p in params],
        shapes=[tuple(p.shape) for _, p in params],
        names=[n for n, _ in params],
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        hidden_size=int(getattr(config, "hidden_size", 0) or 0),
        num_layers=int(getattr(config, "num_hidden_layers", 0) or 0),
        frozen_shapes=[tuple(p.shape) for _, p in frozen],
        frozen_names=[n for n, _ in frozen],
        expert_names=tuple(expert_tensors(model)),
    )
