"""Sharded model construction and loading at world 2 (gloo), for five model families.

One pair of worker processes loads every (family, strategy) case through the trainer's own
`load_model` / `build_engine` and writes what it measured; the tests below check it:

- each rank's parameters hold exactly its part of the checkpoint (or of the seeded init)
  - bit for bit, and the init is the world-1 init (`build_model` in one process);
- the load phase's peak, by tensor accounting (torch's MemTracker: every storage allocated
  while loading), is this rank's part plus at most one module's tensors - never the model;
- every family trains two steps with activation checkpointing under FSDP2 and ZeRO-3, and
  the loss falls on a repeated batch.

Families: Llama (sharded safetensors with an index), Qwen2 (tied embeddings), OPT (blocks at
`model.decoder.layers`, learned positions), GPT-NeoX (blocks at `gpt_neox.layers`, a bf16
file), GPT-2 (blocks at `transformer.h`, tied, Conv1D projections). Mixture of experts: Qwen3-MoE
(8 experts) under FSDP2, saved one tensor per expert (the Hub's layout), which transformers'
converters stack into one tensor per projection, an expert at a time here (ZeRO-3's cuts of a
stacked tensor, mid-expert too, and the other MoE families: tests/unit/test_moe_loading.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launching import launch, run_rank
from model_families import VOCAB, save_families, save_moe_families

FAMILIES = ("llama", "qwen2", "opt", "gpt_neox", "gpt2")
STRATEGIES = ("fsdp", "zero3")
# LoRA (adapters injected on the meta device, then sharded and filled like any model): under
# FSDP2, on an untied and a tied model; under ZeRO-3 the base is built partitioned under zero.Init
# and filled, the adapters injected whole after (deepspeed.initialize partitions them).
# QLoRA: the same, with the linears bitsandbytes' NF4 (each weight quantized whole, this rank's codes kept).
LORA_CASES = ["tiny-llama+lora/fsdp", "qwen2+lora/fsdp", "tiny-llama+lora/zero3", "tiny-llama+qlora/fsdp"]
MOE_CASES = ["qwen3_moe/fsdp"]
CASES = [f"{family}/{strategy}" for family in ["tiny-llama", *FAMILIES] for strategy in STRATEGIES] + LORA_CASES + MOE_CASES


# ----------------------------------------------------------------------------- worker
def _worker(dirs_json: str, out_path: str, only: str = "", ac: str = "full") -> None:
    import functools
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from harness.config import load_config, load_strategy
    from harness.distributed import init_distributed, teardown
    from harness.engine import build_engine, hidden_size_of, load_model, plan_engine
    from harness.engine.storage import local_part
    from harness.models import CheckpointWeights, build_model, build_run_model, clean_name, model_spec
    from harness.training import causal_lm_loss

    dirs = json.loads(dirs_json)
    results: dict[str, dict] = {}
    info = None
    cases = [
        (family, strategy)
        for family, strategy in (case.split("/") for case in CASES)
        if not only or f"{family}/{strategy}" in only.split(",")
    ]
    for family, strategy in cases:
        base, _, lora = family.partition("+")
        path = dirs.get(base, base)
        cfg = load_config(
            None,
            [
                *(["lora.enabled=true", "lora.r=4"] if lora else []),
                *(["lora.quantize=nf4"] if lora == "qlora" else []),
                f"model.name={path}",
                f"strategy={strategy}",
                "precision=fp32",
                f"memory.activation_checkpointing={ac}",
                "micro_batch_size=2",
                "grad_accum=1",
                "steps=2",
                "optim.lr=0.01",
                "optim.warmup_steps=0",
            ],
        )
        strategy_obj = load_strategy(cfg.strategy)
        info = info or init_distributed("cpu", force_group=True)
        spec = model_spec(path, vocab_size=VOCAB, seed=cfg.model.seed)
        plan = plan_engine(cfg, strategy_obj, info.world_size, info.device, hidden_size_of(spec.config))

        tracker = MemTracker()
        with tracker:
            model = load_model(spec, cfg, plan, info)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

        # world 1, one process, whole (LoRA: the base built whole (QLoRA: quantized), then the adapters)
        reference = build_run_model(cfg, VOCAB) if lora else build_model(path, vocab_size=VOCAB, seed=cfg.model.seed)
        ref = {name: p.detach() for name, p in reference.named_parameters(remove_duplicate=False)}
        local_bytes, mismatched, largest = 0, [], 0
        seen = set()
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            shape, start, end, view = local_part(p)
            local_bytes += view.numel() * view.element_size()
            full = ref[clean_name(name)]
            largest = max(largest, full.numel() * 4)
            # bit for bit (4-bit codes packed in floats may read as NaN, which equals nothing)
            if not torch.equal(view.view(torch.uint8), full.reshape(-1)[start:end].to(view.dtype).contiguous().view(torch.uint8)):
                mismatched.append(clean_name(name))
        file_equal = None
        if base in dirs and not lora:  # and the reference itself is the file's content, every parameter found in it
            ckpt = CheckpointWeights(path, reference.base_model_prefix)
            ckpt.follow_conversions(reference)
            file_equal = all(
                torch.equal(p.detach().reshape(-1), ckpt.read([n], p.shape, 0, p.numel()).to(p.dtype))
                for n, p in reference.named_parameters()
            )
        buffers = sum(b.numel() * b.element_size() for b in reference.buffers())
        whole = sum(p.numel() * 4 for p in reference.parameters())
        del model, reference, ref

        loss_fn = functools.partial(causal_lm_loss, chunk_size=0)
        engine = build_engine(spec, cfg, plan, info, loss_fn)
        batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(info.rank))
        losses = []
        for _ in range(3):
            loss = engine.forward_loss(batch)
            engine.backward(loss, last_micro=True)
            engine.step()
            losses.append(float(loss.detach()))
        results[f"{family}/{strategy}"] = {
            "peak": peak,
            "local_bytes": local_bytes,
            "largest_tensor": largest,
            "buffers": buffers,
            "whole": whole,
            "mismatched": mismatched,
            "file_equal": file_equal,
            "losses": losses,
            "startup_s": engine.startup_s,
        }
        if hasattr(engine, "ds"):  # DeepSpeed's hooks and buffers go with the engine, before the next one is built
            engine.ds.destroy()
        del engine
        gc.collect()
        dist.barrier()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(gathered))
    teardown()


if __name__ == "__main__" and "--worker" in sys.argv:
    run_rank(_worker, *sys.argv[sys.argv.index("--worker") + 1 :])


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("families")
    dirs = {**save_families(root), **save_moe_families(root, ("qwen3_moe",), experts=8)}
    out = root / "results.json"
    launch(__file__, ["--worker", json.dumps(dirs), str(out)], world=2, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_exactly_its_part_of_the_weights(measured, case):
    for rank, results in enumerate(measured):
        r = results[case]
        assert r["mismatched"] == [], f"rank {rank}: {r['mismatched']} differ from the world-1 model"
        assert r["file_equal"] in (None, True), f"rank {rank}: the world-1 model is not the checkpoint's content"
    # together the ranks hold the model once (ZeRO-3 pads the last partition; FSDP2 pads nothing in storage)
    assert sum(results[case]["local_bytes"] for results in measured) >= measured[0][case]["whole"]


@pytest.mark.parametrize("case", CASES)
def test_load_phase_peak_is_the_shard_plus_one_tensor(measured, case):
    for rank, results in enumerate(measured):
        r = results[case]
        # this rank's part, one module's tensors generated or read whole (at most: the largest tensor
        # and its bias, in fp32), and the buffers (rotary tables: template and model)
        bound = r["local_bytes"] + 2 * r["largest_tensor"] + 3 * r["buffers"]
        if case.endswith("/zero3"):
            # zero.Init broadcasts each new parameter from rank 0 (a uint8 view of it) before
            # partitioning it, and gloo's worker thread drops its reference to that view only when
            # it next runs, after `broadcast` has returned: on a loaded machine the previous
            # parameter's whole tensor is still alive while the next one is built (measured: 2-16%
            # of 2,000 broadcasts on the 2-core host). At most one such tensor: one more `largest`.
            bound += r["largest_tensor"]
        assert r["local_bytes"] <= r["peak"] <= bound, f"rank {rank}: {r}"
        # and that part is a part: at world 2 about half the model (LoRA: plus its small adapters,
        # QLoRA: plus the scales every rank holds), never the whole model built and sharded later
        assert r["local_bytes"] < 0.75 * r["whole"], f"rank {rank} holds {r['local_bytes']} of {r['whole']} bytes"
    # (On these tiny models the embedding is a third of the model, so "less than the whole model"
    # would say little; benchmarks/loading_bench.py shows the same rule at ~300M parameters.)


@pytest.mark.parametrize("case", CASES)
def test_every_family_trains_with_activation_checkpointing(measured, case):
    for rank, results in enumerate(measured):
        losses = results[case]["losses"]
        assert all(loss == loss and loss < 20 for loss in losses), f"rank {rank}: {losses}"
        assert losses[-1] < losses[0], f"rank {rank}: loss did not fall on a repeated batch: {losses}"
