"""How far a Ulysses group's gradients are from exact, beside one process's: SmolLM2-135M
(benchmarks/real_model.py), one random sample of `seq` tokens, fp32. Each of the N ranks runs its
slice with `parallel.sequence=N`'s attention and loss; the group's summed gradients, and rank 0's
one-process fp32 gradients, are compared with one-process fp64 gradients (relative L2 error over
every parameter), so fp32 rounding is told apart from a real difference.

    torchrun --nproc_per_node=3 benchmarks/sequence_parallel_grads.py 768     # N = the world; prints JSON
    torchrun --nproc_per_node=3 benchmarks/sequence_parallel_grads.py 4608 --ac  # full AC, 1024-token loss chunks
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from harness.data import SequenceSlice
from harness.memory import apply_activation_checkpointing
from harness.models import use_ulysses
from harness.training import causal_lm_loss, count_targets, sequence_shard_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model

AC = "--ac" in sys.argv  # long sequences: activation checkpointing and the chunked loss, as a long run trains
CHUNK = 1024 if AC else 0


def load(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    if AC:
        apply_activation_checkpointing(model, "full")
    return model


def group_gradients(model_dir: str, batch: torch.Tensor, rank: int, world: int) -> dict[str, torch.Tensor]:
    """The trainer's arithmetic: each rank's slice loss over the group's counted tokens per rank, gradients averaged."""
    model = load(model_dir, torch.float32)
    use_ulysses(model, dist.new_group(list(range(world))))
    piece = SequenceSlice(rank, world)(batch)
    count = torch.tensor(float(count_targets(piece)))
    dist.all_reduce(count)
    sequence_shard_loss(model, piece, chunk_size=CHUNK, num_items=count / world).backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out[name] = g / world
    return out


def one_process_gradients(model_dir: str, batch: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = load(model_dir, dtype)
    causal_lm_loss(model, batch, chunk_size=CHUNK).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def main() -> None:
    seq = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_dir = str(real_model.prepare())
    batch = torch.randint(0, 49152, (1, seq), generator=torch.Generator().manual_seed(0))
    group = group_gradients(model_dir, batch, rank, world)
    if rank == 0:
        exact = one_process_gradients(model_dir, batch, torch.float64)
        single = one_process_gradients(model_dir, batch, torch.float32)
        scale = norm(exact)
        error = {
            name: norm({n: grads[n].double() - exact[n] for n in exact}) / scale for name, grads in (("one", single), ("group", group))
        }
        print(json.dumps({"seq": seq, "world": world, "ac_and_chunked_loss": AC, "rel_error_one_process_fp32": error["one"],
                          "rel_error_group_fp32": error["group"],
                          "norm_fp64": scale, "norm_one_process_fp32": norm(single), "norm_group_fp32": norm(group)}))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
