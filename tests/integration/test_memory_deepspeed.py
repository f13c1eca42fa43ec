"""The loss and the tracker under a DeepSpeed engine (ZeRO-2 and ZeRO-3, one CPU rank on gloo).

Runs in a subprocess (DeepSpeed needs a process group and sets global state). What the
tracker sees under DeepSpeed, measured here: ZeRO keeps fp32 master partitions and Adam
state inside its own optimizer wrapper, created before any per-step tracker exists, so
MemTracker alone would miss them; the tracker counts them directly as optimizer state
(``optimizer_tensors``). ZeRO-3 parameters live in ``param.ds_tensor`` partitions
(``param.data`` is empty) and are counted from there. ZeRO's gradient partitions and
reduce buckets are flat buffers it allocates itself: MemTracker labels them by the phase
in which they appear (temporaries in backward), not as gradients - a documented limit.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from launching import launch, run_rank


def _worker(out_path: str) -> None:
    import deepspeed
    import torch

    from harness.config import RunConfig, load_strategy, resolve_deepspeed_config
    from harness.distributed import init_distributed, teardown
    from harness.engine import memory_storage, train_collectives_only
    from harness.memory import StepMemoryTracker, optimizer_state_bytes
    from harness.models import build_model
    from harness.training import causal_lm_loss

    init_distributed("cpu", force_group=True)
    train_collectives_only()  # as the engine does: DeepSpeed's inference all-reduce op is not built
    cfg = RunConfig()
    cfg.micro_batch_size, cfg.grad_accum = 2, 1
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {}
    for stage in ("zero2", "zero3"):
        ds = resolve_deepspeed_config(load_strategy(stage), cfg, 1, hidden_size=64)
        model = build_model("tiny-llama", seed=0)
        hf_loss = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        n_tensors = len(list(model.parameters()))
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=ds)
        tracker = StepMemoryTracker(engine, opt, storage=memory_storage(engine))
        losses, plain = [], None
        for step in range(3):
            with tracker.step():
                loss = causal_lm_loss(engine, ids, chunk_size=16)
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
        with torch.no_grad():
            plain = causal_lm_loss(engine, ids).item()
            chunked = causal_lm_loss(engine, ids, chunk_size=16).item()
        out[stage] = {
            "hf_loss": hf_loss,
            "losses": losses,
            "plain_after": plain,
            "chunked_after": chunked,
            "param_bytes": param_bytes,
            "n_tensors": n_tensors,
            "counted_opt": optimizer_state_bytes(opt, engine, memory_storage(engine)),
            "maxima": tracker.last_category_maxima(),
            "peak": tracker.last_peaks(),
            "opt_type": type(opt).__name__,
        }
    with open(out_path, "w") as f:
        json.dump(out, f)
    teardown()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("ds") / "results.json")
    launch(__file__, ["--worker", out], world=1, timeout=180)
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_loss_through_the_engine(results: dict[str, Any], stage: str) -> None:
    r = results[stage]
    assert r["losses"][0] == pytest.approx(r["hf_loss"], rel=1e-6)  # chunked loss inside engine.module
    assert r["losses"][-1] < r["losses"][0]
    assert r["chunked_after"] == pytest.approx(r["plain_after"], rel=1e-6)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_tracker_counts_zero_state(results: dict[str, Any], stage: str) -> None:
    r = results[stage]
    P = r["param_bytes"]
    # One rank holds everything: an fp32 master copy, exp_avg, exp_avg_sq and one 4-byte
    # step counter per ZeRO parameter group (one here). ZeRO-3 empties its inner optimizer's
    # param_groups outside step(): its masters are found in fp32_partitioned_groups_flat.
    # (Were a master the parameter partition itself, it would count once, as a parameter.)
    assert r["counted_opt"] == 3 * P + 4
    assert r["maxima"]["optimizer_state"] >= r["counted_opt"]
    # ZeRO-3: parameters found in their ds_tensor partitions, not in the empty param.data.
    assert r["maxima"]["parameters"] == P


if __name__ == "__main__" and "--worker" in sys.argv:
    run_rank(_worker, sys.argv[sys.argv.index("--worker") + 1])
