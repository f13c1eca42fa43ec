"""The pruning stage through the entry points users run (real processes, gloo on CPU).

- `torchrun --nproc_per_node 2 harness/train.py` with `prune.*` set: FSDP2 and ZeRO-3 at
  world 2 produce the very same masks and per-layer sparsity as world 1 (world 1 runs
  `grad_accum=2`, world 2 `grad_accum=1`: the same global batches, so the same training
  and the same calibration probe steps);
- after `prune.finetune_steps` more steps (under FSDP, ZeRO-3, DDP and ZeRO-2) the exported
  Hugging Face model holds exactly the pruned weights at zero: every masked weight is 0 and
  no other target weight is (so none regrew and nothing else was zeroed);
- metrics.jsonl has the before/after perplexity and per-layer sparsity;
- `python -m harness.prune` on a saved model directory, under torchrun, exports a sparse
  model that reloads with `from_pretrained`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from launching import BIN, call_entry_point, env, free_port, launch_command, run, tiny_config

FINETUNE = 2
STEPS = 3


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


def records(output: Path, kind: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def prune_record(output: Path) -> dict:
    found = records(output, "prune")
    assert len(found) == 1, f"expected one prune record in {output}/metrics.jsonl, found {len(found)}"
    return found[0]


def layer_sparsity(record: dict) -> dict[str, float]:
    prefix = "prune/sparsity/"
    return {k[len(prefix) :]: v for k, v in record.items() if k.startswith(prefix)}


def exported_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir))


def masks_of(model, masks_dir: Path) -> dict[str, torch.Tensor]:
    """The saved masks (any world size) as full boolean matrices of `model`'s targets."""
    from harness.distributed import Collectives
    from harness.pruning import MaskSet, build_views

    views = build_views(model, "decoder_linears", Collectives())
    loaded = MaskSet.load(str(masks_dir), views, Collectives())
    return {v.name: loaded[v.name].reshape(v.rows, v.cols) for v in views}


def weights_of(model) -> dict[str, torch.Tensor]:
    from harness.distributed import Collectives
    from harness.pruning import build_views

    return {v.name: v.param.detach() for v in build_views(model, "decoder_linears", Collectives())}


def assert_exactly_sparse(hf_dir: Path, masks_dir: Path) -> dict[str, torch.Tensor]:
    """Every masked weight of the exported model is exactly 0 and no other target weight is."""
    model = exported_model(hf_dir)
    masks, weights = masks_of(model, masks_dir), weights_of(model)
    for name, mask in masks.items():
        w = weights[name]
        assert mask.any(), f"{name}: nothing pruned"
        assert int((w[mask] != 0).sum()) == 0, f"{name}: {int((w[mask] != 0).sum())} pruned weights regrew"
        assert int((w[~mask] == 0).sum()) == 0, f"{name}: weights outside the mask are zero"
    return masks


def assert_finetuned(output: Path) -> None:
    """The fine-tuning steps ran after pruning (steps STEPS+1..STEPS+FINETUNE, non-zero LR and gradient)."""
    prune_step = prune_record(output)["step"]
    after = [r for r in records(output, "train") if r["step"] > prune_step]
    assert [r["step"] for r in after] == list(range(prune_step + 1, prune_step + FINETUNE + 1))
    assert all(r["train/lr"] > 0 and r["train/grad_norm"] > 0 and math.isfinite(r["train/loss"]) for r in after)


def assert_perplexities(record: dict) -> None:
    for key in ("prune/eval_perplexity_before", "prune/eval_perplexity_after"):
        assert key in record and math.isfinite(record[key]) and record[key] > 1.0, key
    assert record["prune/eval_perplexity_after"] != record["prune/eval_perplexity_before"]  # pruning changed the model


def train_with_pruning(cache: Path, out: Path, world: int, strategy: str, prune: dict) -> None:
    cfg = tiny_config(
        out.parent / f"{out.name}.yaml",
        cache,
        out,
        steps=STEPS,
        strategy=strategy,
        **{"optim.grad_clip": 0.0, "checkpoint.export_hf": True, "prune.finetune_steps": FINETUNE, "prune.calib_samples": 8},
        **{f"prune.{k}": v for k, v in prune.items()},
    )
    if world == 1:
        run(launch_command("python", 1, cfg, []))
    else:
        run(launch_command("torchrun", world, cfg, ["grad_accum=1"]))


WORLD_CASES = {
    # GradProbe 2:4 (veto) under ZeRO-3, through the stage's own data path.
    "zero3": {"method": "gradprobe", "base": "magnitude", "decision": "veto", "pattern": "2:4"},
    # SparseGPT block by block, each block fitted by gradient steps and guarded, under FSDP2.
    # The veto with Wanda candidates under FSDP2 is proven world-invariant, masks surviving training,
    # by test_pruning_dist (the trainer's wrapping, one worker per rank), not again through the stage.
    "fsdp-fit": {"method": "sparsegpt_fit", "fit_epochs": 1},
}


@pytest.mark.parametrize("case", sorted(WORLD_CASES))
def test_stage_world_invariance_and_masks_survive_finetuning(cache: Path, tmp_path: Path, case: str) -> None:
    prune, strategy = WORLD_CASES[case], case.split("-")[0]
    outs = {w: tmp_path / f"w{w}" for w in (1, 2)}
    for world, out in outs.items():
        train_with_pruning(cache, out, world, strategy, prune)

    recs = {w: prune_record(out) for w, out in outs.items()}
    assert recs[1]["step"] == recs[2]["step"] == STEPS
    assert recs[2]["prune/world_size"] == 2
    assert layer_sparsity(recs[1]) == layer_sparsity(recs[2])
    assert recs[1]["prune/achieved_sparsity"] == recs[2]["prune/achieved_sparsity"] == 0.5  # exact-target mode
    for r in recs.values():
        assert_perplexities(r)
    # Same model, same eval blocks: the dense perplexity agrees up to the order of the cross-rank sum.
    assert recs[2]["prune/eval_perplexity_before"] == pytest.approx(recs[1]["prune/eval_perplexity_before"], rel=1e-5)

    masks = {w: assert_exactly_sparse(out / "hf", out / "prune_masks") for w, out in outs.items()}
    for name in masks[1]:
        assert torch.equal(masks[1][name], masks[2][name]), f"{name}: world 1 and world 2 masks differ"
        assert int(masks[1][name].sum()) / masks[1][name].numel() == layer_sparsity(recs[1])[name]
        if prune.get("pattern") == "2:4":
            per_group = masks[1][name].reshape(masks[1][name].shape[0], -1, 4).sum(-1)
            assert bool((per_group == 2).all()), f"{name}: not 2 pruned per group of 4"
    for out in outs.values():
        assert_finetuned(out)


def test_stage_ddp_schedule_and_finetuning(cache: Path, tmp_path: Path) -> None:
    """DDP at world 2, the iterative schedule (Wanda, 0.3 then 0.5, metric on held-out calib blocks)."""
    out = tmp_path / "ddp"
    train_with_pruning(cache, out, 2, "ddp", {"method": "wanda", "schedule": [0.3, 0.5], "max_metric_increase": 100.0})
    rec = prune_record(out)
    assert [r[0] for r in rec["prune/schedule/rounds"]] == [0.3, 0.5]  # both rounds accepted under this limit
    assert rec.get("prune/schedule/stopped_at") is None and rec["prune/achieved_sparsity"] == 0.5  # None: not logged
    assert_perplexities(rec)
    assert_exactly_sparse(out / "hf", out / "prune_masks")
    assert_finetuned(out)


def test_prune_command_on_saved_model(cache: Path, tmp_path: Path) -> None:
    """Train + export a dense model, then `torchrun -m harness.prune` on its directory (ZeRO-2, SparseGPT, 1 fine-tuning step)."""
    dense = tmp_path / "dense"
    cfg = tiny_config(tmp_path / "dense.yaml", cache, dense, steps=2, **{"checkpoint.export_hf": True})
    run(launch_command("python", 1, cfg, []))
    dense_ppl = [r for r in records(dense, "eval")][-1]["eval/perplexity"]

    out = tmp_path / "pruned"
    cfg = tiny_config(
        tmp_path / "prune.yaml",
        cache,
        out,
        **{
            "model.name": str(dense / "hf"),
            "strategy": "zero2",
            "grad_accum": 1,
            "prune.method": "sparsegpt",
            "prune.calib_samples": 8,
            "prune.finetune_steps": 1,
        },
    )
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "harness.prune", "--config", str(cfg)]
    proc = run(cmd)
    assert "pruned model exported to" in proc.stdout

    rec = prune_record(out)
    assert rec["step"] == 0 and rec["prune/method"] == "sparsegpt" and rec["prune/achieved_sparsity"] == 0.5
    assert_perplexities(rec)
    # The command pruned the trained model it loaded: its dense perplexity is the training run's final one.
    assert rec["prune/eval_perplexity_before"] == pytest.approx(dense_ppl, rel=1e-5)
    assert [r["step"] for r in records(out, "train")] == [1]
    masks = assert_exactly_sparse(out / "hf", out / "prune_masks")
    # The exported model is the model harness evaluated last (pruned, then fine-tuned with the masks):
    # transformers loading it as a user does gives the loss harness reported, on the same eval blocks.
    final = [r for r in records(out, "eval")][-1]
    assert transformers_eval_loss(out / "hf", cfg) == pytest.approx(final["eval/loss"], rel=1e-5)

    # Control: without the enforcer, one AdamW step on the exported model regrows pruned weights,
    # so the zeros above are kept by the stage, not an accident of the data.
    model = exported_model(out / "hf")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    weights = weights_of(model)
    assert sum(int((weights[n][m] != 0).sum()) for n, m in masks.items()) > 0


def transformers_eval_loss(model_dir: Path, cfg_path: Path) -> float:
    """Mean token loss of `model_dir` loaded by transformers as a user loads it (its saved dtype,
    the default attention) on the run's eval blocks, the first `eval_batches` micro-batches."""
    from transformers import AutoModelForCausalLM

    from harness.config import load_config
    from harness.data import load_packed, prepare_data, split_batches

    cfg = load_config(str(cfg_path), [])
    data = load_packed(prepare_data(cfg.model.name, cfg.data, progress=False), block_bos=cfg.data.block_bos)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    total = count = 0.0
    for batch, counted in split_batches(data, "eval", cfg.micro_batch_size, cfg.eval_batches, 1, 0):
        assert counted
        with torch.no_grad():
            loss = model(input_ids=batch, labels=batch).loss  # transformers' own shift and mean
        n = batch.shape[0] * (batch.shape[1] - 1)
        total, count = total + float(loss) * n, count + n
    return total / count


def test_prune_command_rejects_bad_input(tmp_path: Path, cache: Path, monkeypatch, capfd) -> None:
    """`python -m harness.prune` refuses each in pre-flight, with exit 2 and one line. Its `main` is
    called in this interpreter (`call_entry_point`): a fresh one per case would import torch again."""
    import harness.prune

    cfg = tiny_config(tmp_path / "bad.yaml", cache, tmp_path / "bad")
    cases = {
        "prune.method=none": "needs prune.method",
        "prune.sparsity=1.5": "prune.sparsity=1.5 must be in [0, 1)",
        "prune.calib_samples=2": "cannot fill one probe step",
        "prune.decision=original": "prune.decision=original is GradProbe's rule",
        ("prune.method=gradprobe", "prune.decision=original", "prune.group_size=2"): "prune.group_size=2 with prune.decision=original",
        ("prune.method=gradprobe", "prune.decision=veto", "prune.exact_target=false"): "the undershooting veto",
    }
    for override, message in cases.items():
        if isinstance(override, tuple):
            args = list(override)
        else:
            args = [override] if override.startswith("prune.method") else ["prune.method=wanda", override]
        code, stderr, shown = call_entry_point(harness.prune.main, ["--config", str(cfg), *args], env(), monkeypatch, capfd)
        assert code == 2 and message in stderr, (override, stderr[-2000:])
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("harness.prune: error: "), (override, stderr[-2000:])
        assert not shown, (override, [f"{w.category.__name__}: {w.message}" for w in shown])
        assert not (tmp_path / "bad").exists()  # rejected before anything was written
