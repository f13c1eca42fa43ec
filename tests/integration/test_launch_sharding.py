"""Every CPU-runnable strategy, and every launcher under every engine family, 2 real processes:
sharding proven by bytes.

For world 2 each rank must hold the expected share of parameters, gradients and optimizer
state (ZeRO-1: optimizer state halved; ZeRO-2: + gradients; ZeRO-3/FSDP: + parameters), and
the loss must match a world-1 run on the same global batch. Nothing here trusts a flag:
bytes come from the tensors each rank actually holds (harness/engine/state_bytes.py). The bf16
FSDP2 run also checks that per-step memory metrics are the worst rank's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import final_eval, launch_command, run, side_by_side, state_bytes, step_losses, tiny_config

from harness.config import shipped_facts
from harness.models import build_model, count_parameters
from harness.observability.metrics import MAX_RSS, MEMORY_TOTAL, PEAK_RANK, read_records

# Fractions of the full fp32 model size P each rank holds at world 2 (grads: the peak
# during accumulation; ZeRO-1 keeps full gradients until the boundary, ZeRO-2 does not).
EXPECTED = {
    "ddp": {"params": 1, "grads": 1, "optim_state": 2, "master_params": 0},
    "zero1": {"params": 1, "grads": 1, "optim_state": 1, "master_params": 0.5},
    "zero2": {"params": 1, "grads": 0.5, "optim_state": 1, "master_params": 0.5},
    # Offload: on a CPU-only machine host and device are the same memory, so only the shares
    # a stage must halve are checked; DeepSpeed's host-side staging buffers add bytes here
    # that a GPU run keeps in host memory (see notes/core.md).
    "zero2_offload": {"optim_state": 1, "master_params": 0.5},
    "zero3": {"params": 0.5, "grads": 0.5, "optim_state": 1, "master_params": 0.5},
    "zero3_offload": {"params": 0.5, "grads": 0.5, "optim_state": 1, "master_params": 0.5},
    "fsdp": {"params": 0.5, "grads": 0.5, "optim_state": 1, "master_params": 0},
    "fsdp_grad_op": {"params": 0.5, "grads": 0.5, "optim_state": 1, "master_params": 0},
    # CPUOffloadPolicy runs on a CPU machine (no pinned memory); every shard on the host, which is the device here
    "fsdp_offload": {"params": 0.5, "grads": 0.5, "optim_state": 1, "master_params": 0},
}
# What a launcher decides (the environment contract: ranks, world size, rendezvous, and for
# accelerate/deepspeed their own plugins and rank bookkeeping) is independent of which ZeRO stage
# or FSDP2 variant the run then applies itself; what differs is the engine family. So every
# launcher runs every engine family (DDP; FSDP2; ZeRO; ZeRO with offload) and every strategy runs
# under at least one launcher: 12 launches instead of the 27 of the full product (each 2 ranks +
# the launcher's own interpreters). The byte checks are the engine's, the same under any launcher.
PAIRS = [
    ("ddp", "torchrun"),
    ("fsdp_offload", "torchrun"),
    ("zero1", "torchrun"),
    ("zero3_offload", "torchrun"),
    ("ddp", "accelerate"),
    ("fsdp", "accelerate"),
    ("zero3", "accelerate"),
    ("zero2_offload", "accelerate"),
    ("ddp", "deepspeed"),
    ("fsdp_grad_op", "deepspeed"),
    ("zero2", "deepspeed"),
    ("zero3_offload", "deepspeed"),
]


# accelerate's own flags choose the strategy: this pair is launched with `--use_fsdp` (no config
# file) and no `strategy=` in the run config, and must shard exactly as strategy=fsdp does
FLAGS_CHOOSE = ("fsdp", "accelerate")
ACCELERATE_FSDP_FLAGS = ["--use_fsdp", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def family(strategy: str) -> tuple[str, bool]:
    """The engine family a launcher meets, from the strategy file's facts: its kind, and for
    DeepSpeed whether it offloads."""
    facts = shipped_facts(strategy)
    return facts.kind, facts.kind == "deepspeed" and facts.offloads_optimizer


assert {s for s, _ in PAIRS} == set(EXPECTED)  # every strategy
LAUNCHERS = ("torchrun", "accelerate", "deepspeed")
assert {(family(s), launcher) for s, launcher in PAIRS} == {(family(s), launcher) for s in EXPECTED for launcher in LAUNCHERS}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, data_cache, tiny_data):
    root = tmp_path_factory.mktemp("launch")
    cache = data_cache
    # World-1 references: same global batch (2 micro × 4 accumulation × 1 = 2 × 2 × 2), fp32 and
    # bf16 FSDP2 (for `bf16_runs`); two one-process runs side by side, the data cache ready (`tiny_data`).
    ref_out, bf16_ref_out = root / "ref", root / "bf16-ref"
    config = tiny_config(root / "ref.yaml", cache, ref_out, grad_accum=4)
    bf16_config = tiny_config(root / "bf16-ref.yaml", cache, bf16_ref_out, grad_accum=4, precision="bf16", strategy="fsdp")
    side_by_side(lambda: run(launch_command("python", 1, config, [])), lambda: run(launch_command("python", 1, bf16_config, [])))
    n_params = count_parameters(build_model("tiny-llama", vocab_size=512))
    return {
        "root": root,
        "cache": cache,
        "bf16_ref": bf16_ref_out,
        "ref_losses": step_losses(ref_out),
        "ref_eval": final_eval(ref_out),
        "P": 4 * n_params,
        "n_params": n_params,
    }


@pytest.mark.parametrize(("strategy", "launcher"), PAIRS, ids=[f"{s}-{launcher}" for s, launcher in PAIRS])
def test_two_ranks_shard_and_match_world_one(workspace, strategy, launcher):
    out = workspace["root"] / f"{strategy}-{launcher}"
    config = tiny_config(workspace["root"] / f"{strategy}-{launcher}.yaml", workspace["cache"], out)
    by_flags = (strategy, launcher) == FLAGS_CHOOSE
    cmd = launch_command(launcher, 2, config, [] if by_flags else [f"strategy={strategy}"])
    if by_flags:
        cmd[cmd.index("--config_file") : cmd.index("--config_file") + 2] = ACCELERATE_FSDP_FLAGS
    proc = run(cmd)
    assert f"{workspace['n_params']:,} params" in proc.stdout  # the whole model's size, however it is sharded
    # DeepSpeed's inference all-reduce op is not started (`train_collectives_only`): no build, and none of
    # its segments (one per rank, named by the rendezvous port) in /dev/shm
    assert "shm_comm_op built successfully" not in proc.stdout + proc.stderr
    port = (
        next(a.split("=")[1] for a in cmd if a.startswith("--master_port="))
        if "--main_process_port" not in cmd
        else cmd[cmd.index("--main_process_port") + 1]
    )
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")), port
    losses = step_losses(out)
    assert losses == pytest.approx(workspace["ref_losses"], rel=1e-3), (losses, workspace["ref_losses"])
    assert final_eval(out) == pytest.approx(workspace["ref_eval"], rel=1e-3)
    P = workspace["P"]
    for rank in (0, 1):
        held = state_bytes(out, rank)
        for category, fraction in EXPECTED[strategy].items():
            # DeepSpeed pads partitions for alignment (up to ~16 KiB on this model) and keeps
            # tiny norm weights whole; 0.5 vs 1 is still unmistakable.
            assert held[category] == pytest.approx(fraction * P, rel=0.05, abs=32768), (strategy, rank, category, held)


@pytest.fixture(scope="module")
def bf16_runs(workspace):
    """bf16 FSDP2: the world-1 reference (run by `workspace`) and a torchrun world-2 run with
    per-step memory tracking; (reference output, world-2 output). Two tests check the world-2 run."""
    root = workspace["root"]
    ref_out, out = workspace["bf16_ref"], root / "bf16-fsdp"
    # with per-step memory tracking on: FSDPMemTracker must follow the trainer's FSDP layout
    config = tiny_config(root / "bf16-fsdp.yaml", workspace["cache"], out, precision="bf16", strategy="fsdp", **{"memory.track": True})
    run(launch_command("torchrun", 2, config, []))
    return ref_out, out


def test_bf16_world_two_matches_world_one_within_bf16_tolerance(bf16_runs):
    ref_out, out = bf16_runs
    assert step_losses(out) == pytest.approx(step_losses(ref_out), rel=2e-2)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    split = [r for r in rows if r.get("kind") == "train" and MEMORY_TOTAL in r]  # steps 0 and 1 by default
    assert len(split) == 2 and all(r[MEMORY_TOTAL] > 0 and r["memory/communication_max_bytes"] > 0 for r in split)


def test_each_step_reports_the_worst_ranks_memory(bf16_runs):
    """Memory metrics come from the rank that peaked highest, not from rank 0 alone (checked
    on the tracked FSDP2 torchrun launch above)."""
    _, out = bf16_runs
    steps = [r for r in read_records(str(out / "metrics.jsonl")) if "train/loss" in r]
    assert len(steps) == 3  # the run's steps
    assert all(r[PEAK_RANK] in (0, 1) and r[MAX_RSS] > 0 for r in steps)  # the peak counter: every step
    assert MEMORY_TOTAL not in steps[2]  # memory.track_every's default: the split on steps 0 and 1, not 2
    for r in steps[:2]:
        split = sum(v for k, v in r.items() if k.endswith("_peak_bytes") and k != MEMORY_TOTAL and not k.startswith(("memory/device_",)))
        assert r["memory/total_peak_bytes"] > 0 and split == r["memory/total_peak_bytes"]  # one rank's split, whole
        assert all(
            r[k.replace("_peak_bytes", "_max_bytes")] >= r[k]
            for k in r
            if k.endswith("_peak_bytes") and k != "memory/total_peak_bytes" and k.replace("_peak_bytes", "_max_bytes") in r
        )
