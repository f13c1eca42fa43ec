"""Checkpoints through the user's entry points: exact resume, world-size changes, SIGKILL mid-save, export.

The claim under test: a run resumed from step k logs the same losses at steps k+1..N as
the run that wrote the checkpoint did when it went on without stopping. At the same world
size that is bit-exact on CPU fp32 (same data position, optimizer state, schedule and RNG);
across world sizes (DCP resharding for FSDP2, DeepSpeed's universal checkpoint for ZeRO) the
reduction order changes, so the bound is the one between world 1 and world 2 runs.

Chains keep the number of launches down; each run resumes from the previous one:
  single (world 1, every 2) --1->2--> fsdp x2 --2->1--> fsdp x1,   fsdp x2 --2->2--> fsdp x2
  zero3 x1 (every 2)        --1->2--> zero3 x2 --2->1--> zero3 x1
A ZeRO-3 resume at the same world size is DeepSpeed's own `load_checkpoint` of its own shards: proven
bit-exact at world 2 by QLoRA's ZeRO-3 chain (tests/integration/test_lora_runs.py); here
ZeRO-3's full state goes through the universal checkpoint both ways.
Global batch 8 everywhere (world 1: grad_accum 4; world 2: grad_accum 2).
The FSDP launches that depend only on the same earlier run go side by side (`side_by_side`);
the ZeRO ones do not (several DeepSpeed processes at once race to JIT-build its CPU ops when
the torch extensions cache is cold or built for another path).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from launching import REPO, env, launch_command, side_by_side, tiny_config

from harness.checkpoint import CheckpointManager, latest_checkpoint, read_meta
from harness.errors import CheckpointError
from harness.observability.metrics import read_records
from harness.pruning import MaskSet

WORLD_CHANGE_RTOL = 1e-4  # world 1 vs world 2 fp32 reduction order (observed: < 1e-6)


def _run(cmd: list[str], extra_env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    e = env()
    e.update(extra_env or {})
    proc = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def losses(out: Path) -> dict[int, float]:
    """Train loss by step; the last record of a step wins (a resumed run re-logs what it redoes)."""
    return {r["step"]: r["train/loss"] for r in read_records(str(out / "metrics.jsonl")) if "train/loss" in r}


def final_eval(out: Path) -> float:
    return [r["eval/loss"] for r in read_records(str(out / "metrics.jsonl")) if "eval/loss" in r][-1]


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def ws(tmp_path_factory, data_cache):
    return {"root": tmp_path_factory.mktemp("ckpt"), "cache": data_cache}


def launch(ws, name: str, world: int, *overrides: str, extra_env: dict[str, str] | None = None) -> tuple[Path, subprocess.CompletedProcess]:
    out = ws["root"] / name
    config = tiny_config(
        ws["root"] / f"{name}.yaml",
        ws["cache"],
        out,
        steps=6,
        grad_accum=4 if world == 1 else 2,
        **{"checkpoint.every": 2, "checkpoint.keep": 3},
    )
    cmd = launch_command("python" if world == 1 else "torchrun", world, config, list(overrides))
    return out, _run(cmd, extra_env)


@pytest.fixture(scope="module")
def single_ref(ws):
    """The uninterrupted single-process reference: 6 steps, checkpoints at 2, 4, 6. It is started
    in the background (a world-1 run uses one of the two cores); `single_ref()` waits for it and
    returns its output directory, so the first test's own runs go on beside it."""
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(launch, ws, "single", 1)
        yield lambda: started.result()[0]


def test_single_sigkill_mid_save_keeps_previous_and_resume_is_bit_exact(ws, single_ref):
    out = ws["root"] / "killed"
    config = tiny_config(
        ws["root"] / "killed.yaml", ws["cache"], out, steps=6, grad_accum=4, **{"checkpoint.every": 2, "checkpoint.keep": 3}
    )
    e = env()
    e["HARNESS_FAULT"] = "save_pause=120@4"  # step 4's checkpoint: fully written, then a window before the rename
    proc = subprocess.Popen(
        launch_command("python", 1, config, []), cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    pending = step_dir(out, 4).parent / ".tmp-step_00000004"
    deadline = time.monotonic() + 120
    while not (pending / "meta.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    root = out / "checkpoints"
    assert latest_checkpoint(str(root)) == str(step_dir(out, 2)), (root / "latest").read_text()
    assert read_meta(str(step_dir(out, 2))).step == 2 and not step_dir(out, 4).exists() and pending.exists()

    resumed = _run(launch_command("python", 1, config, ["checkpoint.resume=auto"]))
    assert f"resumed from {step_dir(out, 2)} at step 2" in resumed.stdout
    ref, got = losses(single_ref()), losses(out)
    assert [got[s] for s in (3, 4, 5, 6)] == [ref[s] for s in (3, 4, 5, 6)]  # bit-exact
    assert not pending.exists(), "the killed save's temp directory was not cleaned up"
    assert latest_checkpoint(str(root)) == str(step_dir(out, 6))


def _shard_balance(files: list[Path]) -> list[float]:
    sizes = [f.stat().st_size for f in files]
    return [s / sum(sizes) for s in sizes]


def test_fsdp_resume_same_world_bit_exact_and_across_world_sizes(ws, single_ref):
    single = single_ref()
    ref = losses(single)
    # 1 -> 2: the single run's step-2 checkpoint into FSDP2 on two ranks (DCP reshards).
    f2, _ = launch(ws, "fsdp2", 2, "strategy=fsdp", f"checkpoint.resume={step_dir(single, 2)}")
    got = losses(f2)
    assert sorted(got) == [3, 4, 5, 6]
    assert [got[s] for s in (3, 4, 5, 6)] == pytest.approx([ref[s] for s in (3, 4, 5, 6)], rel=WORLD_CHANGE_RTOL)
    # Each rank wrote its own shards: neither file holds the whole model + optimizer state.
    shards = sorted((step_dir(f2, 4) / "dcp").glob("*.distcp"))
    assert len(shards) == 2 and max(_shard_balance(shards)) < 0.6, [s.stat().st_size for s in shards]

    # Both resume FSDP2's step-4 checkpoint, side by side (see `side_by_side`).
    (f1, _), (again, _) = side_by_side(
        lambda: launch(ws, "fsdp1", 1, "strategy=fsdp", f"checkpoint.resume={step_dir(f2, 4)}"),
        lambda: launch(ws, "fsdp2b", 2, "strategy=fsdp", f"checkpoint.resume={step_dir(f2, 4)}", "checkpoint.export_hf=true"),
    )
    # 2 -> 1: into a single process.
    assert [losses(f1)[s] for s in (5, 6)] == pytest.approx([got[s] for s in (5, 6)], rel=WORLD_CHANGE_RTOL)

    # 2 -> 2: bit-exact, and the end-of-run export reproduces the run's own final eval loss.
    assert [losses(again)[s] for s in (5, 6)] == [got[s] for s in (5, 6)]
    assert _eval_exported(ws, again / "hf") == pytest.approx(final_eval(again), rel=1e-5)


def test_zero3_resume_across_world_sizes_and_export_in_one_process(ws):
    z1, _ = launch(ws, "zero3_w1", 1, "strategy=zero3")
    ref = losses(z1)
    # 1 -> 2: DeepSpeed cannot repartition a ZeRO checkpoint itself; the universal conversion does.
    z2, proc = launch(ws, "zero3_w2", 2, "strategy=zero3", f"checkpoint.resume={step_dir(z1, 2)}")
    assert "universal checkpoint (world size 1 -> 2)" in proc.stdout
    got = losses(z2)
    assert [got[s] for s in (3, 4, 5, 6)] == pytest.approx([ref[s] for s in (3, 4, 5, 6)], rel=WORLD_CHANGE_RTOL)
    parts = sorted((step_dir(z2, 4) / "ds" / "state").glob("zero_pp_rank_*_optim_states.pt"))
    assert len(parts) == 2 and max(_shard_balance(parts)) < 0.6, [p.stat().st_size for p in parts]

    # 2 -> 1
    z1b, _ = launch(ws, "zero3_w1b", 1, "strategy=zero3", f"checkpoint.resume={step_dir(z2, 4)}")
    assert [losses(z1b)[s] for s in (5, 6)] == pytest.approx([got[s] for s in (5, 6)], rel=WORLD_CHANGE_RTOL)

    # Export a world-2 ZeRO-3 checkpoint in one plain process (no process group, no world size).
    hf = ws["root"] / "zero3_hf"
    _run([sys.executable, "-m", "harness.export", str(step_dir(z2, 6)), "--out", str(hf)])
    assert _eval_exported(ws, hf) == pytest.approx(final_eval(z2), rel=1e-5)


def _eval_exported(ws, hf: Path) -> float:
    """The eval loss of an exported directory loaded by plain `from_pretrained`, on the trainer's eval blocks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.config import load_config
    from harness.data import load_packed, prepare_data, split_batches
    from harness.training import causal_lm_loss

    cfg = load_config(str(tiny_config(ws["root"] / "eval_export.yaml", ws["cache"], ws["root"] / "unused")))
    data = load_packed(prepare_data(cfg.model.name, cfg.data))
    model = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    assert len(AutoTokenizer.from_pretrained(str(hf))) == data.vocab_size
    total = count = 0.0
    with torch.no_grad():
        for batch, _ in split_batches(data, "eval", cfg.micro_batch_size, cfg.eval_batches, 1, 0):
            total += float(causal_lm_loss(model, batch)) * batch.shape[0]
            count += batch.shape[0]
    return total / count


def _in_process(tmp_path: Path, *overrides: str):
    """The real single-process engine and manager, without launching anything."""
    import functools

    from harness.config import load_config, load_strategy
    from harness.distributed import DistInfo
    from harness.engine import build_engine, plan_engine
    from harness.models import model_spec
    from harness.training import causal_lm_loss

    cfg = load_config(None, ["model.name=tiny-llama", f"output_dir={tmp_path}", *overrides])
    strategy = load_strategy("ddp")
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    engine = build_engine(
        model_spec("tiny-llama", vocab_size=64),
        cfg,
        plan_engine(cfg, strategy, 1, info.device, None),
        info,
        functools.partial(causal_lm_loss, chunk_size=0),
    )
    return engine, CheckpointManager(cfg, strategy, info, engine)


def test_masks_rng_optimizer_round_trip_and_keep_last_k(tmp_path):
    engine, manager = _in_process(tmp_path, "checkpoint.keep=2")
    batch = torch.randint(0, 64, (2, 16))
    engine.backward(engine.forward_loss(batch), last_micro=True)
    engine.step()
    masks = {"model.layers.0.mlp.up_proj.weight": torch.rand(176, 64) < 0.5}
    manager.register_masks(MaskSet(masks), sharded=False)  # the pruning stage's Stateful
    for step in (1, 2, 3):
        manager.save(step, {"skipped_steps": 7})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]  # keep=2
    expected_rng = torch.get_rng_state()
    expected_opt = {k: v.clone() for k, v in engine.optimizer.state[next(engine.module.parameters())].items()}
    torch.manual_seed(12345)  # a different RNG stream and a fresh engine: all of it must come back
    fresh, manager2 = _in_process(tmp_path, "checkpoint.keep=2", "checkpoint.resume=auto")
    state = manager2.restore()
    assert state.step == 3 and state.counters == {"skipped_steps": 7}
    assert state.masks.keys() == masks.keys() and all(torch.equal(state.masks[k], masks[k]) for k in masks)
    assert torch.equal(torch.get_rng_state(), expected_rng)
    got_opt = fresh.optimizer.state[next(fresh.module.parameters())]
    assert all(torch.equal(got_opt[k], v) for k, v in expected_opt.items())
    assert all(torch.equal(a, b) for a, b in zip(fresh.module.parameters(), engine.module.parameters()))
    assert fresh.lr == engine.lr


def test_never_writes_a_checkpoint_with_nan_weights(tmp_path):
    """In-process, on the real engine and manager: a NaN weight makes save() refuse and write nothing."""
    engine, manager = _in_process(tmp_path)
    good = manager.save(1)
    with torch.no_grad():
        next(engine.module.parameters())[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"refusing to write a checkpoint at step 2.*last good checkpoint is .*step_00000001"):
        manager.save(2)
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step_00000001"]
    assert latest_checkpoint(str(root)) == good
