"""Does DeepSpeed's AutoEP (the `expert_parallel` config block, 0.19) train a transformers 5 MoE model
here, and does it equal one process? A probe, outside harness (harness does not wire AutoEP yet).

A tiny random Qwen3-MoE of `tests/model_families.py` (4 experts, top-2), a fixed global batch of
4 rows x 32 tokens split over the ranks, AdamW lr 1e-2, three steps; rank 0 prints each step's mean
loss and DeepSpeed's global gradient norm.

    torchrun --nproc_per_node 1 benchmarks/autoep_probe.py --ep 1             # the reference
    torchrun --nproc_per_node 2 benchmarks/autoep_probe.py --ep 2 --stage 2   # AutoEP, ZeRO-2
    torchrun --nproc_per_node 2 benchmarks/autoep_probe.py --ep 2 --no-shim   # as shipped: fails

DeepSpeed 0.19.8 with transformers 5.25 fails in `deepspeed.initialize`. AutoEP retargets
transformers' router-logit recorders and calls `_CAN_RECORD_REGISTRY.get(key, default)`, but 5.25's
registry is a dict subclass whose `get` takes one model ("TypeError: _CanRecordRegistry.get() takes
2 positional arguments but 3 were given"). `--shim` (the default) gives that `get` the dict's
two-argument form for string keys while the engine is built. Results are in notes/moe.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


@contextlib.contextmanager
def registry_accepts_a_default() -> Iterator[None]:
    """transformers 5.25's `_CanRecordRegistry.get(model)`, also callable as `dict.get(name, default)`."""
    from transformers.utils import output_capturing

    registry = output_capturing._CanRecordRegistry
    one_argument = registry.get

    def get(self, key, default=None):
        return dict.get(self, key, default) if isinstance(key, str) else one_argument(self, key)

    registry.get = get
    try:
        yield
    finally:
        registry.get = one_argument


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2, help="autoep_size (1: no AutoEP)")
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage")
    parser.add_argument("--aux", action="store_true", help="ask for the router logits; print transformers' aux loss")
    parser.add_argument("--no-shim", dest="shim", action="store_false", help="build the engine as DeepSpeed ships")
    args = parser.parse_args()

    import deepspeed
    import torch.distributed as dist
    from model_families import moe_configs
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_configs(4)["qwen3_moe"])
    per = 4 // world
    config = {
        "train_micro_batch_size_per_gpu": per,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": 0.0,
    }
    if args.ep > 1:  # the CPU has no grouped GEMM kernel of DeepSpeed's: its per-expert loop
        config["expert_parallel"] = {"enabled": True, "autoep_size": args.ep, "preset_model": "qwen3_moe", "use_grouped_mm": False}
    with registry_accepts_a_default() if args.shim else contextlib.nullcontext():
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    held = sum(int(getattr(p, "ds_tensor", p).numel()) for p in engine.module.parameters())
    if rank == 0:
        print(f"world {world}: {type(engine.module.model.layers[0].mlp).__name__}, {held:,} parameter elements on rank 0", flush=True)
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(5))
    mine = ids[rank * per : (rank + 1) * per]
    for step in range(1, 4):
        out = engine(input_ids=mine, labels=mine, output_router_logits=args.aux)
        engine.backward(out.loss)
        engine.step()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        if rank == 0:
            aux = f", aux {float(out.aux_loss):.6f}" if args.aux else ""
            print(f"step {step}: loss {float(loss) / world!r}, grad norm {float(engine.get_global_grad_norm()):.6f}{aux}", flush=True)


if __name__ == "__main__":
    main()
