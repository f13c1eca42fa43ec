"""Every labelled token of a step weighs the same, however the step's global batch is split.

Instruction data (labelled counts differ from block to block), one global batch of 8 blocks,
split as (micro_batch_size, grad_accum, world) = (8,1,1), (4,2,1), (2,2,2) and (1,4,2), under
every engine: the per-step losses, and the final eval loss, equal a reference loop written
here with HF's own loss on the whole global batch (one mean over all its labelled tokens).
A per-micro-batch mean (each micro-batch weighing the same) differs from it by ~1e-3 here.

The DDP run also counts its gradient all-reduces (`recording_worker.py`): one round per
optimizer step, every bucket once, in the last micro-batch's backward; the others accumulate
locally (`Engine.micro_batch`: DDP decides at the forward whether the backward all-reduces).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from launching import (
    INSTRUCTION_WORDS,
    TESTS,
    final_eval,
    instruction_file,
    launch_command,
    run,
    side_by_side,
    step_losses,
    tiny_config,
)
from launching import launch as launch_ranks

from harness.config import load_config
from harness.data import BatchSampler, cache_dir_for, load_packed, prepare_data
from harness.models import build_model
from harness.training import build_optimizer, build_scheduler

STEPS = 3
RTOL = 1e-6  # fp32; world 2 vs world 1 is a different reduction order
# (micro_batch_size, grad_accum, world, strategy, extra overrides): each engine at world 2 with
# accumulation, each world-2 split under two engines; optimizer-in-backward under FSDP2.
SPLITS = {
    "w1_8x1": (8, 1, 1, None, ()),
    "w1_4x2": (4, 2, 1, None, ()),
    "ddp_1x4": (1, 4, 2, "ddp", ()),
    "fsdp_2x2": (2, 2, 2, "fsdp", ()),
    "zero2_1x4": (1, 4, 2, "zero2", ()),
    "zero3_2x2": (2, 2, 2, "zero3", ()),
    "fsdp_oib_2x2": (2, 2, 2, "fsdp", ("memory.optimizer_in_backward=true",)),
}


def uneven_instructions(path: Path, n: int) -> Path:
    """`instruction_file`'s records with answers of 1 to 10 words: packed longest first, blocks of
    long answers carry several times the labels of blocks of short ones."""
    rng = random.Random(1)
    records = [json.loads(line) for line in instruction_file(path, n).read_text().splitlines()]
    for rec in records:
        words = [rng.choice(INSTRUCTION_WORDS) for _ in range(rng.randint(1, 10))]
        if "messages" in rec:
            rec["messages"][-1]["content"] = " ".join(words)
        else:
            rec["response"] = " " + " ".join(words)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def ws(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("token-weighting")
    return {"root": root, "data": uneven_instructions(root / "instructions.jsonl", 400), "cache": data_cache}


def config(ws, name: str, micro: int, accum: int) -> Path:
    return tiny_config(
        ws["root"] / f"{name}.yaml",
        ws["cache"],
        ws["root"] / name,
        steps=STEPS,
        micro_batch_size=micro,
        grad_accum=accum,
        eval_batches=10_000,  # every eval block, whatever the micro-batch: one eval set for every split
        **{
            "data.source": str(ws["data"]),
            "data.format": "instruction",
            "data.seq_len": 64,
            "data.eval_fraction": 0.1,
            "data.max_tokens": None,
            "optim.grad_clip": 0.0,  # optimizer-in-backward cannot clip; the reference does not either
        },
    )


RECORDER = str(TESTS / "integration" / "recording_worker.py")


def launch(ws, name: str) -> Path:
    """Run split `name`; the DDP split's ranks through `recording_worker.py` (its `rank<r>.json`
    in the split's directory), the others as the user launches them."""
    micro, accum, world, strategy, extra = SPLITS[name]
    overrides = [*([f"strategy={strategy}"] if strategy else []), *extra]
    out, cfg = ws["root"] / name, config(ws, name, micro, accum)
    if strategy == "ddp":
        out.mkdir(parents=True, exist_ok=True)
        launch_ranks(RECORDER, [str(out), "--config", str(cfg), *overrides], world=world)
    else:
        run(launch_command("python" if world == 1 else "torchrun", world, cfg, overrides))
    return out


@pytest.fixture(scope="module")
def reference(ws) -> tuple[list[float], float]:
    """Per-step losses and final eval loss of a hand loop: the whole global batch in one forward
    (each packed example attending to itself: its positions), HF's loss (the mean over its
    labelled tokens), AdamW and the schedule the runs use."""
    cfg = load_config(str(config(ws, "reference", 8, 1)))
    data = load_packed(prepare_data(cfg.model.name, cfg.data, progress=False))
    model = build_model(cfg.model.name, vocab_size=data.vocab_size, seed=cfg.model.seed)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps)
    sampler = BatchSampler(data, 8, 1, 1, 0, cfg.data.seed)
    losses = []
    for step in range(STEPS):
        batch = sampler.batch(step, 0)
        loss = model(input_ids=batch[:, 0], labels=batch[:, 1], position_ids=batch[:, 2], use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(float(loss.detach()))
    ev = torch.from_numpy(data.blocks["eval"][:].astype("int64"))
    with torch.no_grad():
        eval_loss = float(model(input_ids=ev[:, 0], labels=ev[:, 1], position_ids=ev[:, 2], use_cache=False).loss)
    return losses, eval_loss


@pytest.fixture(scope="module")
def world_one(ws) -> dict[str, Path]:
    names = ["w1_8x1", "w1_4x2"]
    return dict(zip(names, side_by_side(*(lambda n=n: launch(ws, n) for n in names))))


def test_the_data_has_uneven_label_counts(ws, reference):
    """Every step's global batch holds blocks of different labelled counts, so a per-micro-batch
    mean would weigh their tokens differently than one mean over the step."""
    cfg = load_config(str(ws["root"] / "reference.yaml"))
    sampler = BatchSampler(load_packed(cache_dir_for(cfg.model.name, cfg.data)), 8, 1, 1, 0, cfg.data.seed)
    for step in range(STEPS):
        counts = (sampler.batch(step, 0)[:, 1, 1:] != -100).sum(dim=1).tolist()
        assert max(counts) >= 1.5 * min(counts), (step, counts)


@pytest.mark.parametrize("name", ["w1_8x1", "w1_4x2"])
def test_world_one_splits_equal_the_reference(world_one, reference, name):
    losses, eval_loss = reference
    assert step_losses(world_one[name]) == pytest.approx(losses, rel=RTOL)
    assert final_eval(world_one[name]) == pytest.approx(eval_loss, rel=RTOL)


@pytest.mark.parametrize("name", [n for n, split in SPLITS.items() if split[2] == 2])
def test_world_two_splits_equal_the_reference_under_every_engine(ws, reference, name):
    losses, eval_loss = reference
    out = launch(ws, name)
    assert step_losses(out) == pytest.approx(losses, rel=RTOL)
    assert final_eval(out) == pytest.approx(eval_loss, rel=RTOL)
    if SPLITS[name][3] == "ddp":  # one all-reduce round per step: each bucket once, in the last micro-batch
        last = SPLITS[name][1] - 1
        for rank in range(2):
            steps = json.loads((out / f"rank{rank}.json").read_text())["ddp_buckets"]
            assert len(steps) == STEPS, (rank, steps)
            for buckets in steps:
                indices = sorted(index for _, index in buckets)
                assert indices == list(range(len(indices))) and indices, (rank, steps)
                assert all(micro == last for micro, _ in buckets), (rank, steps)
