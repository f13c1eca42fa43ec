"""The parallel layout: how a run's ranks split its work, resolved once from the parallel section
and the world, and read by everything that needs to know who does what.

Before it, the data x sequence arithmetic was written out where it was needed (the sampler, the
mesh, the checkpoint's data position, `--check`'s reference batch, DeepSpeed's batch filling) and
held together by docstrings. Now the layout is built once per run (pre-flight puts it in the
engine plan; the planner builds the one a candidate would run) and the sampler, the engines, the
checkpoint, `--check`, the planner and the OOM advice read it. torchtitan's `ParallelDims` is
the pattern: the dimensions, the rank arithmetic, and the meshes, handed out from one object.

The world is a grid of `data` x `sequence` ranks, grouped consecutively: rank = data_rank x
sequence + sequence_rank. A sequence group (`sequence` consecutive ranks) trains one data-parallel
rank's samples, each rank a slice of every sequence; gradients are still reduced over the whole
world (the group's ranks hold different parts of the gradient).

Experts (`expert`, torchtitan's and transformers' expert parallelism): the expert dimension is
carved out of the data-parallel ranks, not added beside them. Each rank still reads its own
data-parallel rank's samples (the sampler, the global batch and the checkpoint's data position are
those of `data`, as without experts); what changes is who holds which experts: every MoE layer's
experts are split into `expert` consecutive ranges, rank r holding range `expert_rank(r)` =
r % expert, and each token is sent to its experts' ranks and back (an all-to-all over the
`expert_group`). Ranks r and r + expert hold the same experts: an `expert_replica_group`
(world / expert ranks, one per expert range). Gradients: the parameters outside the experts are
reduced over the whole world as before; an expert's gradient already holds every token of its
expert group that was routed to it (the all-to-all's backward brings them), so it is summed only
over its replica group (none at expert = world) and divided by the world, as the rest are.
Experts and sequences split together: a MoE layer routes each token on its own, so a rank sends its
slice's tokens to their experts' ranks as it would whole sequences' (the expert ranges are counted
over the world, across sequence groups); the router's balance is taken over the whole sequences
(`harness.training.router`), and the expert gradients' reduction is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.config.schema import ParallelConfig
from harness.errors import ConfigError

if TYPE_CHECKING:  # torch.distributed is imported where a mesh is built, not by the config
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ParallelLayout:
    """The world's ranks as a data x sequence grid, experts split over ranks of either (see the module docstring)."""

    world: int = 1
    sequence: int = 1  # ranks sharing each sequence (Ulysses; DeepSpeed's ALST under DeepSpeed)
    expert: int = 1  # ranks each MoE layer's experts are split over (expert parallelism)

    def __post_init__(self) -> None:
        if self.sequence < 1 or self.world % self.sequence:
            raise ConfigError(
                f"parallel.sequence={self.sequence} must divide the world size ({self.world}): each group of {self.sequence} ranks "
                "shares its samples"
            )
        if self.expert < 1 or self.world % self.expert:
            raise ConfigError(
                f"parallel.expert={self.expert} must divide the world size ({self.world}): each group of {self.expert} ranks "
                "holds one copy of every expert"
            )

    @classmethod
    def of(cls, parallel: ParallelConfig, world: int) -> ParallelLayout:
        """The layout the parallel section asks for at `world` ranks (ConfigError, one line, where
        it cannot be laid out)."""
        return cls(world=world, sequence=parallel.sequence, expert=parallel.expert)

    @property
    def data(self) -> int:
        """The data-parallel world: how many ranks read different samples."""
        return self.world // self.sequence

    @property
    def splits_sequences(self) -> bool:
        return self.sequence > 1

    def data_rank(self, rank: int) -> int:
        """Which data-parallel rank's samples `rank` reads (its sequence group's)."""
        return rank // self.sequence

    def sequence_rank(self, rank: int) -> int:
        """Which slice of every sequence `rank` holds, within its group."""
        return rank % self.sequence

    @property
    def splits_experts(self) -> bool:
        return self.expert > 1

    @property
    def expert_replicas(self) -> int:
        """How many ranks hold each expert: the size of an expert replica group."""
        return self.world // self.expert

    def expert_rank(self, rank: int) -> int:
        """Which of the `expert` ranges of every MoE layer's experts `rank` holds."""
        return rank % self.expert

    def experts_of(self, rank: int, num_experts: int) -> range:
        """The experts (of `num_experts`, which `expert` divides) `rank` holds."""
        per_rank = num_experts // self.expert
        return range(self.expert_rank(rank) * per_rank, (self.expert_rank(rank) + 1) * per_rank)

    def expert_replica_ranks(self, rank: int) -> list[int]:
        """The ranks that hold the same experts as `rank` (itself included): its expert gradients' reduction."""
        return list(range(self.expert_rank(rank), self.world, self.expert))

    def global_batch(self, micro_batch: int, grad_accum: int) -> int:
        """Samples per optimizer step: micro x accumulation x the data-parallel world."""
        return micro_batch * grad_accum * self.data

    def describe(self) -> str:
        """The start-up line's words for the split ('' when nothing is split but the data)."""
        words = [f"each sequence split over {self.sequence} ranks"] if self.splits_sequences else []
        words += [f"experts split over {self.expert} ranks"] if self.splits_experts else []
        return ", ".join(words)

    def mesh(self, device_type: str) -> DeviceMesh:
        """The world's ("data", "sequence") device mesh over the current process group. Collective:
        every rank asks, and the caller keeps what it gets (a later process group, the planner's
        fake one included, gets its own)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.data, self.sequence), mesh_dim_names=("data", "sequence"))

    def shard_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh FSDP2 shards over and reduces gradients on: every rank of the world (a sequence
        group's ranks hold different parts of the gradient, which only that reduction sums)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.world,))

    def sequence_group(self, device_type: str) -> ProcessGroup:
        """This rank's sequence group: the ranks that share its sequences."""
        return self.mesh(device_type).get_group("sequence")

    def expert_mesh(self, device_type: str) -> DeviceMesh:
        """The world's ("expert_replica", "expert", "same_batch") device mesh: rank = replica x expert +
        expert_rank. "same_batch" is the ranks that hold the same tokens (transformers' `tp_mesh` in its
        expert dispatch), each rank alone: a sequence group's ranks hold different slices. Collective, like `mesh`."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.expert_replicas, self.expert, 1)
        return init_device_mesh(device_type, shape, mesh_dim_names=("expert_replica", "expert", "same_batch"))
