"""One rank of the optimizer matrix (test_optimizers.py): every optimizer this engine can run, with
and without accumulation and optimizer-in-backward, on the harness's own engine (built from its
plan, saved and restored through its own DCP path).

For each case: train 4 steps saving after step 2, keep the parameters; build a fresh engine, load
the step-2 state (and the RNG stream: stochastic rounding draws from it, as the checkpoint manager
restores it), train steps 3-4: the parameters must be equal to the bit. After the first run's step 4,
the optimizer-state and parameter bytes this rank holds are compared with the planner's account
(`optimizer_state_bytes` over this rank's local numels). Prints one JSON line per case on rank 0.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
from launching import run_rank

from harness.config import RunConfig, load_strategy
from harness.distributed import init_distributed, local_tensor
from harness.engine import build_engine, plan_engine
from harness.models import model_spec
from harness.training import causal_lm_loss, optimizer_shared_bytes, optimizer_state_bytes

STEPS, VOCAB, SEQ, MICRO = 4, 512, 32, 2


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def train(engine, first: int, last: int, accum: int, rank: int) -> None:
    for step in range(first, last):
        for m in range(accum):
            last_micro = m == accum - 1
            engine.backward(engine.forward_loss(batch(step, m, rank)), last_micro)
        engine.step()


def build(cfg: RunConfig, strategy, info):
    plan = plan_engine(cfg, strategy, info.world_size, info.device, None)
    return build_engine(model_spec("tiny-llama", vocab_size=VOCAB, seed=0), cfg, plan, info, causal_lm_loss)


def params(engine) -> list[torch.Tensor]:
    return [local_tensor(p).detach().clone() for p in engine.model.parameters()]


def case(strategy_name: str, name: str, precision: str, accum: int, oib: bool, info, work: str) -> dict:
    cfg = RunConfig()
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.grad_clip = name, 1e-2, 1, 0.0
    cfg.optim.weight_decay = 0.01
    cfg.precision, cfg.grad_accum, cfg.steps = precision, accum, STEPS
    cfg.memory.optimizer_in_backward = oib
    strategy = load_strategy(strategy_name)
    torch.manual_seed(0)
    engine = build(cfg, strategy, info)
    train(engine, 0, 2, accum, info.rank)
    directory = os.path.join(work, f"{name}-{precision}-{accum}-{oib}")
    engine.save_state(directory)
    trainer_state, rng = engine.trainer_state(), torch.get_rng_state()
    train(engine, 2, STEPS, accum, info.rank)
    want = params(engine)
    held = engine.state_bytes()
    dtype = next(engine.model.parameters()).dtype
    numels = [local_tensor(p).numel() for p in engine.model.parameters()]
    groups = [[n] for n in numels] if oib else [numels]
    planned = sum(optimizer_state_bytes(name, n, dtype) for n in numels) + sum(optimizer_shared_bytes(name, g) for g in groups)
    planned_params = sum(numels) * torch.empty((), dtype=dtype).element_size()
    del engine
    fresh = build(cfg, strategy, info)
    fresh.load_state(directory, info.world_size, info.rank == 0)
    fresh.load_trainer_state(trainer_state)
    torch.set_rng_state(rng)
    train(fresh, 2, STEPS, accum, info.rank)
    got = params(fresh)
    exact = all(torch.equal(a, b) for a, b in zip(want, got))
    moved = any(not torch.equal(a, b) for a, b in zip(want, params(build(cfg, strategy, info))))
    return {
        "case": f"{strategy_name}/{name}/{precision}/accum{accum}/oib{int(oib)}",
        "rank": info.rank,
        "exact": exact,
        "trained": moved,
        "optim_state": held["optim_state"],
        "planned_optim_state": planned,
        "params": held["params"],
        "planned_params": planned_params,
    }


def main() -> None:
    strategy_name, cases = sys.argv[1], json.loads(sys.argv[2])
    info = init_distributed("cpu", 120.0, force_group=strategy_name == "fsdp")
    work = sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp()
    results = [case(strategy_name, *c, info=info, work=work) for c in cases]
    gathered: list = [None] * info.world_size
    if dist.is_initialized():
        dist.all_gather_object(gathered, results)
    else:
        gathered = [results]
    if info.rank == 0:
        for rank_results in gathered:
            for r in rank_results:
                print("RESULT " + json.dumps(r), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(main)
