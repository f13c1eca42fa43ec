"""Expert parallelism (`parallel.expert`) with sequence parallelism, under FSDP2, trains what one
process trains, each of 4 ranks holding a quarter of the experts and a quarter of the rest.

A tiny random Qwen3-MoE (2 layers, 4 experts, top-2; transformers' expert plan), fp32, the router's
aux loss on, through the user's entry points: `torchrun --nproc_per_node=4 harness/train.py ...
strategy=fsdp parallel.sequence=2 parallel.expert=2` (ranks 0-1 and 2-3 each share their samples,
each rank a half of every sequence, Ulysses' exchange around attention; every layer's 4 experts
split in two ranges, ranks 0 and 2 holding one, 1 and 3 the other, each rank's slice's tokens
exchanged by all-to-all over gloo; the router balanced over the whole sequences, its logits
gathered over the sequence group; FSDP2 shards each range over the two ranks holding it and
everything else over all four, saving a checkpoint at step 2) beside `python -m harness.train` at
world 1 on the same global batch (grad_accum 4 for the 2 data ranks' 2 x 2).
Every step's loss, aux loss and gradient norm (clipped at 1.0, so the norm's expert share, summed with the
FSDP2 shards' and the clip coefficient are all exercised; a missing or doubled division of the
expert gradients moves it) agree within 1e-5 (each slice balanced on its own, the aux loss was
8e-4 off at step 1, measured); each rank's parameter and gradient bytes, counted by
the engine, are a quarter of the world-1 run's: a quarter of the experts (half split, that half
sharded over its replicas) plus a quarter of the rest, which would not be so if the experts were
left whole on their ranks or the rest unsharded; and the step-2 checkpoint, written as each rank's
shard of its experts, resumes at world 1 (DCP reassembles them) and trains step 3 to the same loss
and eval loss. World 2 (each range on one rank, in bf16 too) is planned and measured by
`test_planner_moe.py` and judged per parameter by `--check` (`test_check.py`), as is the same split
under DDP.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RTOL = 1e-5


def _metric(output: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r[key] for r in rows if key in r]


def _expert_bytes(directory: str) -> int:
    from harness.models import empty_model, expert_tensors, model_config

    return sum(p.numel() * 4 for p in expert_tensors(empty_model(model_config(directory))).values())  # fp32


@pytest.mark.integration
def test_four_ranks_splitting_sequences_and_experts_under_fsdp2_train_as_one_process(tmp_path, data_cache):
    from launching import final_eval, launch_command, run, side_by_side, state_bytes, tiny_config
    from model_families import save_moe_families

    model = save_moe_families(tmp_path, ("qwen3_moe",), experts=4)["qwen3_moe"]
    common = {"model.name": model, "precision": "fp32", "steps": 3}
    ep_cfg = tiny_config(tmp_path / "ep.yaml", data_cache, tmp_path / "ep", **common, **{"checkpoint.every": 2})
    one_cfg = tiny_config(tmp_path / "one.yaml", data_cache, tmp_path / "one", **common, grad_accum=4)
    ep, _ = side_by_side(
        lambda: run(launch_command("torchrun", 4, ep_cfg, ["strategy=fsdp", "parallel.sequence=2", "parallel.expert=2"])),
        lambda: run(launch_command("python", 1, one_cfg, ["strategy=ddp"])),
    )
    assert "global batch 8 x 32 tokens" in ep.stdout + ep.stderr
    assert "each sequence split over 2 ranks, experts split over 2 ranks (transformers' expert plan)" in ep.stdout + ep.stderr
    for key in ("train/loss", "train/aux_loss", "train/grad_norm"):
        got, want = _metric(tmp_path / "ep", key), _metric(tmp_path / "one", key)
        assert len(got) == 3 and got == pytest.approx(want, rel=RTOL), key
    experts = _expert_bytes(model)
    whole = state_bytes(tmp_path / "one", 0)
    assert 0 < experts < whole["params"]
    for rank in range(4):
        held = state_bytes(tmp_path / "ep", rank)
        for kind in ("params", "grads"):
            assert held[kind] == experts // 4 + (whole[kind] - experts) // 4, (rank, kind, whole[kind], held[kind], experts)

    resumed_cfg = tiny_config(tmp_path / "resumed.yaml", data_cache, tmp_path / "resumed", **common, grad_accum=4)
    saved = tmp_path / "ep" / "checkpoints" / "step_00000002"
    run(launch_command("python", 1, resumed_cfg, ["strategy=ddp", f"checkpoint.resume={saved}"]))
    assert _metric(tmp_path / "resumed", "train/loss") == pytest.approx(_metric(tmp_path / "ep", "train/loss")[2:], rel=RTOL)
    assert final_eval(tmp_path / "resumed") == pytest.approx(final_eval(tmp_path / "ep"), rel=RTOL)
