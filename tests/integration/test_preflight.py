"""Pre-flight: each bad input exits non-zero with one actionable line, before any process group.

Every case runs the user's entry point (`python -m harness.train --config … key=value`)
as rank 0 of a 2-process job (RANK=0, WORLD_SIZE=2, a MASTER_PORT nobody listens on). Had
the run reached `init_process_group`, rank 0 would wait for a rank 1 that never comes and
the case would time out; so a prompt exit proves no process group started. The output
directory must not exist afterwards (nothing written), or, for the output-directory
rule, must be byte-for-byte what it was.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launching import REPO, env, free_port, run, tiny_config

TIMEOUT = 60  # a case that hangs this long has started a process group
CPU_ONLY = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the bad input is only bad without a GPU")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Files the cases point at, and one real run's checkpoints (the output-directory and resume rules)."""
    root = tmp_path_factory.mktemp("preflight")
    cache = tmp_path_factory.getbasetemp() / "ckpt-data-cache"
    done = root / "done_run"
    cfg = tiny_config(root / "done.yaml", cache, done, steps=2, **{"checkpoint.every": 1})
    run([sys.executable, "-m", "harness.train", "--config", str(cfg)])
    (root / "empty_dir").mkdir()
    (root / "notext.jsonl").write_text(json.dumps({"content": "hello world"}) + "\n")
    (root / "a_file").write_text("not a directory")
    (root / "bad.yaml").write_text("steps: 3\noptim:\n\tlr: 0.1\n")
    (root / "bad.json").write_text('{"steps": 3,\n "model": {"name": "tiny-llama",}}\n')
    ds = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    (root / "zero5.json").write_text(json.dumps({**ds, "zero_optimization": {**ds["zero_optimization"], "stage": 5}}))
    (root / "batch64.json").write_text(json.dumps({**ds, "train_batch_size": 64}))
    (root / "auto_hole.json").write_text(json.dumps({**ds, "zero_optimization": {**ds["zero_optimization"], "sub_group_size": "auto"}}))
    return {"root": root, "cache": cache, "done": done}


def _checkpoint(ws) -> str:
    return str(ws["done"] / "checkpoints" / "step_00000001")


# (id, extra run-config keys, overrides, expected text in the message). Values may use {root}, {ckpt}, {done}.
CASES = [
    ("invalid_yaml", None, ["--config", "{root}/bad.yaml"], "invalid YAML at line 3"),
    ("invalid_json", None, ["--config", "{root}/bad.json"], "invalid JSON at line 2"),
    ("unknown_key", {}, ["optim.lrr=0.1"], "did you mean 'optim.lr'"),
    ("sparsity_out_of_range", {}, ["prune.sparsity=1.0"], "must be in [0, 1)"),
    ("n_not_below_m", {}, ["prune.pattern=4:4"], "0 < N < M"),
    ("m_does_not_divide_width", {}, ["prune.method=magnitude", "prune.pattern=3:6"], "M=6 must divide"),
    ("unknown_strategy", {}, ["strategy=zero4"], "did you mean"),
    ("zero_stage_out_of_range", {}, ["strategy={root}/zero5.json"], "stage must be 0, 1, 2 or 3"),
    ("nvme_path_missing", {}, ["strategy=zero3_nvme"], "nvme_path='/local_nvme' is missing or not writable"),
    pytest.param("fsdp_offload_without_gpu", {}, ["strategy=fsdp_offload"], "FSDP2 CPU offload needs a GPU", marks=CPU_ONLY),
    pytest.param("fp16_fsdp_without_gpu", {}, ["strategy=fsdp", "precision=fp16"], "fp16 with FSDP2 needs a GPU", marks=CPU_ONLY),
    ("ds_batch_disagrees", {}, ["strategy={root}/batch64.json"], "train_batch_size=64 contradicts"),
    ("auto_where_number_needed", {}, ["strategy={root}/auto_hole.json"], "'zero_optimization.sub_group_size' is 'auto'"),
    ("optimizer_in_backward_deepspeed", {}, ["strategy=zero2", "memory.optimizer_in_backward=true"], "cannot run under DeepSpeed"),
    pytest.param("cuda_without_gpu", {}, ["device=cuda"], "no GPU is visible", marks=CPU_ONLY),
    ("model_path_missing", {}, ["model.name=./no/such/model"], "does not exist"),
    ("model_id_offline", {}, ["model.name=nobody-xyz/no-such-model"], "HF_HUB_OFFLINE=1"),
    ("dataset_missing", {}, ["data.source=/no/such/corpus"], "does not exist"),
    ("dataset_empty_dir", {}, ["data.source={root}/empty_dir"], "is an empty directory"),
    ("dataset_no_text_field", {}, ["data.source={root}/notext.jsonl"], "has no field 'text'"),
    ("tokenizer_missing", {}, ["data.tokenizer=/no/such/tokenizer"], "does not exist"),
    ("seq_len_beyond_positions", {}, ["data.seq_len=1024"], "exceeds the model's 512 positions"),
    ("global_batch_not_divisible_by_world", {}, ["global_batch_size=6"], "not divisible by micro_batch_size*world (2*2=4)"),
    ("global_batch_disagrees", {}, ["global_batch_size=16"], "set grad_accum=4"),
    ("accelerate_precision_disagrees", {"ACCELERATE_MIXED_PRECISION": "bf16"}, [], "contradicts the run config's precision"),
    ("output_dir_is_a_file", {}, ["output_dir={root}/a_file"], "is not a directory"),
    ("output_dir_has_other_checkpoints", {}, ["output_dir={done}"], "already holds checkpoints of another run"),
    ("resume_path_missing", {}, ["checkpoint.resume=/no/such/checkpoint"], "does not exist"),
    ("resume_other_engine", {}, ["checkpoint.resume={ckpt}", "strategy=zero2"], "resume it with ddp or fsdp"),
    ("resume_other_global_batch", {}, ["checkpoint.resume={ckpt}", "grad_accum=4"], "global batch"),
]


def _snapshot(path) -> dict[str, tuple[int, float]]:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.join(d, f)] = (st.st_size, st.st_mtime)
    return out


def _id(case) -> str:
    return case.values[0] if hasattr(case, "values") else case[0]


def _run_case(ws, tmp, name, extra_env, args) -> tuple[subprocess.CompletedProcess, bool]:
    fill = {"root": ws["root"], "ckpt": _checkpoint(ws), "done": ws["done"]}
    args = [a.format(**fill) for a in args]
    tmp.mkdir()
    out = tmp / "out"
    if "--config" in args:
        cmd = [sys.executable, "-m", "harness.train", *args, f"output_dir={out}"]
    else:
        # The done run's world was 1 with grad_accum 2: at world 2 the same global batch needs grad_accum 1.
        accum = [] if any(a.startswith("grad_accum=") for a in args) else ["grad_accum=1"]
        config = tiny_config(tmp / "run.yaml", ws["cache"], out)
        cmd = [sys.executable, "-m", "harness.train", "--config", str(config), *accum, *args]
    e = env()
    e.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    e.update(extra_env or {})
    proc = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=TIMEOUT)
    return proc, out.exists()


@pytest.fixture(scope="module")
def results(ws):
    """Every case, three at a time (each is a fresh interpreter importing torch: seconds of CPU)."""
    from concurrent.futures import ThreadPoolExecutor

    before = _snapshot(ws["done"])
    gpu = __import__("torch").cuda.is_available()
    cases = [c.values if hasattr(c, "values") else c for c in CASES if not (gpu and hasattr(c, "marks"))]
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {c[0]: pool.submit(_run_case, ws, ws["root"] / f"case-{c[0]}", *c[:3]) for c in cases}
        out = {name: f.result() for name, f in futures.items()}
    return out, _snapshot(ws["done"]) == before


@pytest.mark.parametrize("name, extra_env, args, expected", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_fails_before_any_process_group(results, name, extra_env, args, expected):
    by_case, untouched = results
    proc, wrote = by_case[name]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("harness: error: "), proc.stderr[-2000:]
    assert expected in lines[0], lines[0]
    assert not wrote, "a failed pre-flight wrote into the output directory"
    assert untouched, "a failed pre-flight touched an existing run's files"


def test_output_dir_rule_allows_resume_and_overwrite(ws, tmp_path):
    """The same directory is accepted with resume=auto (continues) and overwrite=true (replaces, announced)."""
    config = tiny_config(tmp_path / "run.yaml", ws["cache"], ws["done"], steps=3, **{"checkpoint.every": 1})
    resumed = run([sys.executable, "-m", "harness.train", "--config", str(config), "checkpoint.resume=auto"])
    assert "resumed from" in resumed.stdout and "step_00000002" in resumed.stdout
    fresh = run([sys.executable, "-m", "harness.train", "--config", str(config), "steps=1", "checkpoint.overwrite=true"])
    assert "checkpoint.overwrite=true: deleting" in fresh.stdout
    remaining = sorted(p.name for p in (ws["done"] / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert remaining == ["step_00000001"], remaining
