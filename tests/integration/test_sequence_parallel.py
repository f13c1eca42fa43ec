"""Ulysses sequence parallelism (`parallel.sequence`) trains what one process trains.

Two launches of 2 gloo ranks (tiny Llama: 4 heads, 2 key/value heads, so grouped-query
attention is split too; and with 1 key/value head, which the group replicates):

- the gradients: each rank runs its slice of every sample through the model with Ulysses
  attention (with activation checkpointing and the chunked loss), and the group's summed
  gradients equal those of the whole sequences in one process, parameter by parameter, as do
  the summed loss and the logits of each slice;
- packed instruction data: blocks of several examples (one straddling the slices' boundary),
  labels on the answers only, positions restarting with each example: the slices' summed
  gradients equal one process's, where transformers keeps the examples apart by the positions
  (and differ from attention across the examples, which the same slices give without them);
- the train command: a world-1 run (grad_accum 2) saves a checkpoint at step 2; a world-2 run
  with parallel.sequence=2 under FSDP2 (data-parallel size 1: every gradient is reduced over the
  sequence group only) resumes from it at that other N and trains steps 3-4 with the same
  losses, gradient norms and eval loss as the world-1 run; and world-2 DeepSpeed ZeRO-2 and
  ZeRO-3 runs whose file asks for `sequence_parallel_size: 2` (DeepSpeed's own Ulysses, ALST)
  train all 4 steps as the world-1 run does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

RTOL = 1e-5  # fp32; the slices' reductions run in another order than the whole sequence's


def _group_grads_against(model, reference, world: int) -> tuple[float, bool]:
    """The group's mean gradients against one process's: the largest relative difference, and
    whether every parameter's is within RTOL. Collective."""
    import torch
    import torch.distributed as dist

    worst, close = 0.0, True
    for p, q in zip(model.parameters(), reference.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= world
        worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-12)).item())
        close = close and torch.allclose(g, q.grad, rtol=RTOL, atol=1e-7)
    return worst, close


def _worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from harness.data import SequenceSlice
    from harness.memory import apply_activation_checkpointing
    from harness.models import build_model, use_ulysses
    from harness.training import causal_lm_loss, count_targets, sequence_shard_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = build_model("tiny-llama", vocab_size=512, seed=3)
    model = build_model("tiny-llama", vocab_size=512, seed=3)
    apply_activation_checkpointing(model, "full")
    use_ulysses(model, dist.new_group(list(range(world))))
    batch = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(7))
    batch[1, 40:] = (batch[1, 40:] + 1) % 512  # two different samples
    whole = causal_lm_loss(reference, batch)
    whole.backward()
    piece = SequenceSlice(rank, world)(batch)
    # the trainer's rule: the step's counted tokens over all ranks, per micro-batch and rank; the
    # engine then averages the ranks' gradients (here: summed, then divided by the world)
    count = torch.tensor(float(count_targets(piece)))
    dist.all_reduce(count)
    loss = sequence_shard_loss(model, piece, chunk_size=24, num_items=count / world)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[name] = (g / world, q.grad)
    with torch.no_grad():
        width = batch.shape[1] // world
        mine = model(input_ids=piece[:, 0, :-1], position_ids=piece[:, 2, :-1]).logits
        theirs = reference(input_ids=batch).logits[:, rank * width : (rank + 1) * width]
    if rank == 0:
        worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in grads.values())
        result = {
            "whole": float(whole),
            "sum": float(total / world),
            "count": float(count),
            "targets": int(count_targets(batch)),
            "worst_grad_rel": worst,
            "grads_close": all(torch.allclose(a, b, rtol=RTOL, atol=1e-7) for a, b in grads.values()),
            "n_grads": len(grads),
            "logits_diff": float((mine - theirs).abs().max()),
        }
    # multi-query attention: one key/value head, fewer than the group, replicated over it
    reference = build_model("tiny-llama", vocab_size=512, seed=3, config_overrides={"num_key_value_heads": 1})
    model = build_model("tiny-llama", vocab_size=512, seed=3, config_overrides={"num_key_value_heads": 1})
    use_ulysses(model, dist.new_group(list(range(world))))
    causal_lm_loss(reference, batch).backward()
    sequence_shard_loss(model, piece, chunk_size=24, num_items=count / world).backward()
    worst, close = _group_grads_against(model, reference, world)
    if rank == 0:
        result["mqa"] = {"kv_heads": model.config.num_key_value_heads, "worst_grad_rel": worst, "grads_close": close}
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def _packed_batch(vocab: int) -> torch.Tensor:
    """Two packed (input_ids, labels, position_ids) blocks of 64 tokens: examples of 20, 25 and 19
    tokens, and of 40 and 24; each example's first 6 tokens are its prompt (unlabelled)."""
    import torch

    rows = []
    for row, lengths in enumerate(((20, 25, 19), (40, 24))):
        ids = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(11 + row))
        labels, positions = ids.clone(), torch.cat([torch.arange(n) for n in lengths])
        labels[positions < 6] = -100
        rows.append(torch.stack([ids, labels, positions]))
    return torch.stack(rows)


def _packed_worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from harness.data import SequenceSlice
    from harness.memory import apply_activation_checkpointing
    from harness.models import build_model, use_ulysses
    from harness.training import count_targets, labelled_lm_loss, sequence_shard_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = build_model("tiny-llama", vocab_size=512, seed=3)
    batch = _packed_batch(512)
    whole = labelled_lm_loss(reference, batch)  # one process: transformers' packed-sequence mask
    whole.backward()
    piece = SequenceSlice(rank, world)(batch)
    count = torch.tensor(float(count_targets(piece)))
    dist.all_reduce(count)
    results = {}
    for name, positions in (("packed", piece), ("across", None)):
        model = build_model("tiny-llama", vocab_size=512, seed=3)
        apply_activation_checkpointing(model, "full")
        use_ulysses(model, dist.new_group(list(range(world))), packed=True)
        if positions is None:  # the same slices, each example's positions made one sequence's: attention crosses examples
            positions = piece.clone()
            positions[:, 2] = torch.arange(rank * 32, rank * 32 + 33)
        loss = sequence_shard_loss(model, positions, chunk_size=24, num_items=count / world)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        worst, close = _group_grads_against(model, reference, world)
        results[name] = {"sum": float(total / world), "worst_grad_rel": worst, "grads_close": close}
    if rank == 0:
        Path(out_path).write_text(json.dumps({"whole": float(whole), "count": float(count), **results}))
    dist.destroy_process_group()


@pytest.mark.integration
def test_packed_examples_stay_apart_under_sequence_slices(tmp_path):
    """Packed instruction data under `parallel.sequence=2`: attention inside each example, as one
    process computes it (a few seconds: two 2-rank steps of tiny Llama on 64 tokens)."""
    from launching import launch

    out = tmp_path / "result.json"
    launch(__file__, ["--packed-worker", str(out)], world=2, timeout=120)
    r = json.loads(out.read_text())
    assert r["packed"]["sum"] == pytest.approx(r["whole"], rel=RTOL)
    assert r["packed"]["grads_close"], r
    assert r["across"]["sum"] != pytest.approx(r["whole"], rel=RTOL) and not r["across"]["grads_close"], r


@pytest.mark.integration
def test_sequence_slices_give_the_whole_sequences_gradients(tmp_path):
    from launching import launch

    out = tmp_path / "result.json"
    launch(__file__, ["--worker", str(out)], world=2, timeout=120)
    r = json.loads(out.read_text())
    assert r["count"] == r["targets"]  # every next-token target counted once, across the slices
    assert r["sum"] == pytest.approx(r["whole"], rel=RTOL)
    assert r["n_grads"] > 10 and r["grads_close"], r
    assert r["logits_diff"] < 1e-5, r
    assert r["mqa"]["kv_heads"] == 1 and r["mqa"]["grads_close"], r  # one key/value head over two ranks: replicated


def _losses(output: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r[key] for r in rows if key in r]


COMMON = {"steps": 4, "eval_batches": 4, "optim.grad_clip": 0.0}


@pytest.fixture(scope="module")
def world_one(tmp_path_factory, data_cache) -> Path:
    """The reference: a world-1 run of 4 steps (grad_accum 2), saving a checkpoint at step 2."""
    from launching import launch_command, run, tiny_config

    root = tmp_path_factory.mktemp("w1")
    run(launch_command("python", 1, tiny_config(root / "w1.yaml", data_cache, root / "w1", **COMMON, **{"checkpoint.every": 2}), []))
    return root / "w1"


@pytest.mark.integration
def test_a_run_resumed_at_another_sequence_split_trains_as_world_one(tmp_path, data_cache, world_one):
    from launching import final_eval, launch_command, run, tiny_config

    saved = world_one / "checkpoints" / "step_00000002"
    assert saved.is_dir(), sorted(p.name for p in world_one.iterdir())
    sp_cfg = tiny_config(tmp_path / "sp.yaml", data_cache, tmp_path / "sp", **COMMON)
    proc = run(launch_command("torchrun", 2, sp_cfg, ["strategy=fsdp", "parallel.sequence=2", f"checkpoint.resume={saved}"]))
    assert "each sequence split over 2 ranks (Ulysses)" in proc.stdout + proc.stderr
    for key in ("train/loss", "train/grad_norm"):
        assert _losses(tmp_path / "sp", key) == pytest.approx(_losses(world_one, key)[2:], rel=RTOL), key
    assert final_eval(tmp_path / "sp") == pytest.approx(final_eval(world_one), rel=RTOL)


ALST_ZERO = {
    "zero2": {"stage": 2},
    "zero3-offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}


@pytest.mark.integration
@pytest.mark.parametrize("zero", list(ALST_ZERO))
def test_deepspeed_runs_its_own_ulysses_and_trains_as_world_one(tmp_path, data_cache, world_one, zero):
    """Under DeepSpeed, `parallel.sequence` (here taken from the file's `sequence_parallel_size`, as
    DeepSpeed's users write it) runs ALST's attention: world 2, data-parallel size 1, so every
    gradient is reduced over the sequence group only; 4 steps with accumulation give the world-1
    run's losses, gradient norms (which tell a summed gradient from a mean: Adam's steps do not)
    and eval loss. ZeRO-2 and ZeRO-3 average the sequence group's gradients differently; ZeRO-3 runs
    with its optimizer and parameters offloaded (ALST's own single-GPU recipe)."""
    from launching import final_eval, launch_command, run, tiny_config

    ds_file = tmp_path / f"{zero}_sp.json"
    ds_file.write_text(json.dumps({"zero_optimization": ALST_ZERO[zero], "sequence_parallel_size": 2}))
    cfg = tiny_config(tmp_path / "ds.yaml", data_cache, tmp_path / "ds", **COMMON)
    proc = run(launch_command("deepspeed", 2, cfg, [f"strategy={ds_file}"]))
    log = proc.stdout + proc.stderr
    assert "parallel.sequence=2 (from" in log and "each sequence split over 2 ranks (DeepSpeed's Ulysses, ALST)" in log, log[-3000:]
    for key in ("train/loss", "train/grad_norm"):
        assert _losses(tmp_path / "ds", key) == pytest.approx(_losses(world_one, key), rel=RTOL), key
    assert final_eval(tmp_path / "ds") == pytest.approx(final_eval(world_one), rel=RTOL)


if __name__ == "__main__" and "--worker" in sys.argv:
    from launching import run_rank

    run_rank(_worker, sys.argv[sys.argv.index("--worker") + 1])
if __name__ == "__main__" and "--packed-worker" in sys.argv:
    from launching import run_rank

    run_rank(_packed_worker, sys.argv[sys.argv.index("--packed-worker") + 1])
