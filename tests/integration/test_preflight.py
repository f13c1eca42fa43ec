"""Pre-flight: each bad input (the battery: CASES) exits 2 with one actionable line, before any process group.

Every case calls the user's entry point (`harness.train.main`, what `python -m harness.train
--config … key=value` runs) as rank 0 of a 2-process job (RANK=0, WORLD_SIZE=2, a
MASTER_PORT nobody listens on), in this interpreter (`launching.call_entry_point`): a fresh
interpreter per case imports torch, transformers and DeepSpeed again (seconds of CPU each,
minutes for the battery). The launcher's environment, the working directory, sys.argv and
the harness logger's rank are set per case and restored after it (monkeypatch);
`init_distributed` is replaced by a function that fails the test, so a case that got past
pre-flight is reported at once instead of waiting for a rank 1 that never comes. Exit 2,
exactly one line on stderr (file descriptor 2), no warning a process would print. The
output directory must not exist afterwards (nothing written), or, for the output-directory
rule, must be byte-for-byte what it was.

A few cases (PROCESS_CASES) also run as real processes, as before, for what only a fresh
interpreter shows: the process's exit status, and that importing everything writes nothing
else on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from launching import REPO, call_entry_point, env, free_port, run, tiny_config

from harness.models import build_model

TIMEOUT = 60  # a case run as a process that hangs this long has started a process group
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the bad input is only bad without a GPU")


@pytest.fixture(scope="module")
def ws(tmp_path_factory, data_cache):
    """Files the cases point at, and one real run's checkpoints (the output-directory and resume rules)."""
    root = tmp_path_factory.mktemp("preflight")
    cache = data_cache
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
    (root / "auto_hole.json").write_text(json.dumps({**ds, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto"}}}))
    (root / "misspelt.json").write_text(
        json.dumps({**{k: v for k, v in ds.items() if k != "zero_optimization"}, "zero_optimisation": ds["zero_optimization"]})
    )
    (root / "misspelt_zero.json").write_text(json.dumps({**ds, "zero_optimization": {**ds["zero_optimization"], "stgae": 2}}))
    (root / "ds_lr.json").write_text(json.dumps({**ds, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}))
    config = build_model("tiny-llama", vocab_size=512, seed=0).config
    for name in ("no_weights", "corrupt_weights"):
        config.save_pretrained(root / name)
    (root / "corrupt_weights" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header" + bytes(64))
    from transformers import BloomConfig, BloomForCausalLM  # attention of its own (eager only)

    BloomForCausalLM(BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=512)).save_pretrained(root / "bloom")
    (root / "latin1.txt").write_bytes("caf\u00e9 au lait, cr\u00e8me br\u00fbl\u00e9e\n".encode("latin-1") * 50)
    (root / "ids.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    np.save(root / "floats.npy", np.zeros(100, dtype=np.float32))
    (root / "odd.bin").write_bytes(bytes(3))
    (root / "alpaca.jsonl").write_text(json.dumps({"instruction": "Sort: b a", "input": ""}) + "\n")
    turns = [{"from": "human", "value": "What is 2+2?"}, {"from": "function_call", "value": "{}"}]
    (root / "sharegpt.jsonl").write_text(json.dumps({"conversations": turns}) + "\n")
    import datasets  # here, not at collection (2 s)

    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a document"]})}).save_to_disk(str(root / "dict_no_train"))
    datasets.Dataset.from_dict({"text": ["a document"] * 50}).save_to_disk(str(root / "saved"))
    (root / "damaged.arrow").write_bytes((root / "saved" / "data-00000-of-00001.arrow").read_bytes()[:300])
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
    pytest.param("fp16_fsdp_without_gpu", {}, ["strategy=fsdp", "precision=fp16"], "fp16 with FSDP2 needs a GPU", marks=CPU_ONLY),
    ("ds_batch_disagrees", {}, ["strategy={root}/batch64.json"], "train_batch_size=64 contradicts"),
    ("auto_where_number_needed", {}, ["strategy={root}/auto_hole.json"], "'scheduler.params.cycle_min_lr' is 'auto'"),
    ("optimizer_in_backward_deepspeed", {}, ["strategy=zero2", "memory.optimizer_in_backward=true"], "cannot run under DeepSpeed"),
    pytest.param("cuda_without_gpu", {}, ["device=cuda"], "no GPU is visible", marks=CPU_ONLY),
    ("model_path_missing", {}, ["model.name=./no/such/model"], "does not exist"),
    # QLoRA runs on CPU (bitsandbytes); what it cannot run under is refused here
    ("qlora_under_zero2", {}, ["lora.enabled=true", "lora.quantize=nf4", "strategy=zero2"], "only nf4 under ZeRO-3"),
    ("qlora_int8_sharded", {}, ["lora.enabled=true", "lora.quantize=int8", "strategy=fsdp"], "quantize=int8 cannot be sharded by FSDP2"),
    ("model_id_offline", {}, ["model.name=nobody-xyz/no-such-model"], "HF_HUB_OFFLINE=1"),
    # the optimizer rungs (harness.training.optim): what an engine or precision cannot run
    ("bf16_pure_round_to_nearest", {}, ["precision=bf16_pure"], "precision=bf16_pure with optim.name=adamw: without an fp32 master"),
    ("bf16_pure_bnb", {}, ["precision=bf16_pure", "optim.name=paged_adamw_8bit"], "use optim.name=adamw_bf16|adamw_8bit|adamw_4bit"),
    ("low_bit_under_deepspeed", {}, ["strategy=zero2", "optim.name=adamw_8bit"], "optim.name=adamw_8bit cannot run under DeepSpeed"),
    ("bf16_pure_under_deepspeed", {}, ["strategy=zero3", "precision=bf16_pure", "optim.name=adamw_bf16"], "keeps fp32 master"),
    ("bnb_under_fsdp", {}, ["strategy=fsdp", "optim.name=paged_adamw_8bit"], "bitsandbytes' 8-bit step takes plain tensors"),
    ("bf16_pure_quantized_fsdp", {}, ["strategy=fsdp", "precision=bf16_pure", "optim.name=adamw_4bit"], "quantized state over bf16"),
    pytest.param("cpu_offload_without_gpu", {}, ["optim.cpu_offload=true"], "optim.cpu_offload=true needs a CUDA GPU", marks=CPU_ONLY),
    ("dataset_missing", {}, ["data.source=/no/such/corpus"], "does not exist"),
    ("dataset_empty_dir", {}, ["data.source={root}/empty_dir"], "is an empty directory"),
    ("dataset_no_text_field", {}, ["data.source={root}/notext.jsonl"], "has no field 'text'"),
    ("tokenizer_missing", {}, ["data.tokenizer=/no/such/tokenizer"], "does not exist"),
    ("seq_len_beyond_positions", {}, ["data.seq_len=1024"], "exceeds the model's 512 positions"),
    ("global_batch_not_divisible_by_world", {}, ["global_batch_size=6"], "not divisible by micro_batch_size*world (2*2=4)"),
    # Ulysses sequence parallelism (parallel.sequence): what it cannot split or run under
    (
        "sequence_packed_under_deepspeed",
        {},
        ["strategy=zero2", "parallel.sequence=2", "data.source={root}/alpaca.jsonl", "data.format=instruction", "data.packing=true"],
        "runs DeepSpeed's ALST, whose sdpa attention would cross the packed examples",
    ),
    ("sequence_not_dividing_world", {}, ["strategy=fsdp", "parallel.sequence=3"], "must divide the world size (2)"),
    # (key/value heads fewer than the group are replicated over it; heads that do not split: refused)
    ("sequence_not_dividing_heads", {"WORLD_SIZE": "8"}, ["strategy=fsdp", "parallel.sequence=8"], "num_attention_heads=4"),
    ("sequence_eager_only_model", {}, ["model.name={root}/bloom", "parallel.sequence=2"], "(eager attention only)"),
    ("aux_loss_for_a_dense_model", {}, ["model.name={root}/bloom", "moe.aux_loss_coef=0.01"], "BloomForCausalLM has no mixture-of-experts"),
    ("aux_loss_not_a_number", {}, ["moe.aux_loss_coef=lots"], "moe.aux_loss_coef='lots' must be auto"),
    ("global_batch_disagrees", {}, ["global_batch_size=16"], "set grad_accum=4"),
    ("accelerate_precision_disagrees", {"ACCELERATE_MIXED_PRECISION": "bf16"}, ["precision=fp32"], "contradicts the run config"),
    ("output_dir_is_a_file", {}, ["output_dir={root}/a_file"], "is not a directory"),
    ("output_dir_has_other_checkpoints", {}, ["output_dir={done}"], "already holds checkpoints of another run"),
    ("resume_path_missing", {}, ["checkpoint.resume=/no/such/checkpoint"], "does not exist"),
    ("resume_other_engine", {}, ["checkpoint.resume={ckpt}", "strategy=zero2"], "resume it with ddp or fsdp"),
    ("resume_other_global_batch", {}, ["checkpoint.resume={ckpt}", "grad_accum=4"], "global batch"),
    # model and data files
    ("model_dir_without_weights", {}, ["model.name={root}/no_weights"], "has config.json but no weights"),
    ("model_weights_corrupt", {}, ["model.name={root}/corrupt_weights"], "are not a readable safetensors file"),
    ("data_not_utf8", {}, ["data.source={root}/latin1.txt"], "is not UTF-8 text"),
    ("pretokenized_without_eos", {}, ["data.source={root}/ids.jsonl"], "set data.eos_id"),
    ("alpaca_without_output", {}, ["data.source={root}/alpaca.jsonl", "data.format=instruction"], "record 1: field 'output' is missing"),
    ("alpaca_as_text", {}, ["data.source={root}/alpaca.jsonl"], "its columns are alpaca records: set data.format=instruction"),
    ("sharegpt_unknown_role", {}, ["data.source={root}/sharegpt.jsonl", "data.format=sharegpt"], "'from' is 'function_call'"),
    ("datasetdict_without_train", {}, ["data.source={root}/dict_no_train"], "is a DatasetDict without a 'train' split"),
    ("arrow_file_damaged", {}, ["data.source={root}/damaged.arrow"], "damaged.arrow' is not a readable Arrow file"),
    ("token_file_of_floats", {}, ["data.source={root}/floats.npy"], "one flat array of integer token ids"),
    ("token_file_partial_element", {}, ["data.source={root}/odd.bin"], "not a whole number of uint16 tokens"),
    ("output_dir_under_a_file", {}, ["output_dir={root}/a_file/run"], "is a file, not a directory"),
    # DeepSpeed files honoured exactly
    ("ds_misspelt_top_level_key", {}, ["strategy={root}/misspelt.json"], "did you mean 'zero_optimization'"),
    ("ds_misspelt_zero_key", {}, ["strategy={root}/misspelt_zero.json"], "did you mean 'stage'"),
    ("ds_lr_contradicts_run_config", {}, ["strategy={root}/ds_lr.json"], "contradicts the run config's optim.lr"),
    # values torch or the loop would reject
    ("lr_negative", {}, ["optim.lr=-0.1"], "optim.lr=-0.1 must be > 0"),
    ("lr_zero", {}, ["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    ("beta_one", {}, ["optim.betas=[0.9, 1.0]"], "must each be in [0, 1)"),
    ("eps_negative", {}, ["optim.eps=-1e-8"], "optim.eps=-1e-08 must be >= 0"),
    ("weight_decay_negative", {}, ["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be >= 0"),
    ("grad_clip_negative", {}, ["optim.grad_clip=-1"], "optim.grad_clip=-1.0 must be >= 0"),
    ("warmup_negative", {}, ["optim.warmup_steps=-1"], "optim.warmup_steps=-1 must be >= 0"),
    ("min_lr_ratio_above_one", {}, ["optim.min_lr_ratio=1.5"], "must be in [0, 1]"),
    ("optimizer_unknown", {}, ["optim.name=lion"], "is not one of adamw, adam, sgd"),
    ("schedule_unknown", {}, ["optim.schedule=step"], "is not one of cosine, linear, constant"),
    ("precision_unknown", {}, ["precision=fp8"], "is not one of fp32, bf16, fp16"),
    ("steps_zero", {}, ["steps=0"], "steps=0 must be >= 1"),
    ("micro_batch_zero", {}, ["micro_batch_size=0"], "micro_batch_size=0 must be >= 1"),
    ("ac_every_zero", {}, ["memory.ac_every=0"], "memory.ac_every=0 must be >= 1"),
    ("loss_chunk_negative", {}, ["memory.loss_chunk_size=-1"], "memory.loss_chunk_size=-1 must be >= 0"),
    ("log_every_zero", {}, ["logging.log_every=0"], "logging.log_every=0 must be >= 1"),
    ("eval_every_negative", {}, ["eval_every=-1"], "eval_every=-1 must be >= 0"),
    ("memory_budget_out_of_range", {}, ["memory.activation_memory_budget=1.5"], "must be in [0, 1]"),
    ("max_tokens_below_one_block", {}, ["data.max_tokens=10"], "less than one block"),
    ("tokenizer_processes_zero", {}, ["data.num_proc=0"], "data.num_proc=0 must be >= 1"),
    ("token_dtype_unknown", {}, ["data.token_dtype=int8"], "is not one of uint16, uint32"),
    ("streaming_with_max_tokens", {}, ["data.streaming=true"], "with data.streaming=true"),
    ("keep_zero_checkpoints", {}, ["checkpoint.keep=0"], "checkpoint.keep=0 must be >= 1"),
    ("prune_calibration_too_small", {}, ["prune.method=wanda", "prune.calib_samples=1"], "cannot fill one probe step"),
    (
        "prune_original_exact_target",
        {},
        ["prune.method=gradprobe", "prune.decision=original", "prune.exact_target=true"],
        "prune.exact_target=true with prune.decision=original",
    ),
    (
        "prune_original_bf16_statistics",
        {},
        ["prune.method=gradprobe", "prune.decision=original", "prune.stat_dtype=bf16"],
        "prune.stat_dtype=bf16 with prune.decision=original",
    ),
    (
        "prune_original_n_m",
        {},
        ["prune.method=gradprobe", "prune.decision=original", "prune.pattern=2:4"],
        "use prune.decision=rank for N:M",
    ),
    (
        "prune_rank_without_exact_target",
        {},
        ["prune.method=gradprobe", "prune.decision=veto", "prune.exact_target=false"],
        "the undershooting veto",
    ),
    (
        "prune_global_sequential_rank",
        {},
        ["prune.method=gradprobe", "prune.decision=veto", "prune.base=magnitude", "prune.scope=global", "prune.sequential=true"],
        "needs every matrix probed before any is pruned",
    ),
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


def _case_argv(ws, tmp: Path, args) -> tuple[list[str], Path]:
    """The entry point's arguments for a case, and the output directory it must not create."""
    fill = {"root": ws["root"], "ckpt": _checkpoint(ws), "done": ws["done"]}
    args = [a.format(**fill) for a in args]
    tmp.mkdir()
    out = tmp / "out"
    if "--config" in args:
        return [*args, f"output_dir={out}"], out
    # The done run's world was 1 with grad_accum 2: at world 2 the same global batch needs grad_accum 1.
    accum = [] if any(a.startswith("grad_accum=") for a in args) else ["grad_accum=1"]
    config = tiny_config(tmp / "run.yaml", ws["cache"], out)
    return ["--config", str(config), *accum, *args], out


def _launch_env(extra_env) -> dict[str, str]:
    """Rank 0 of a 2-process job whose MASTER_PORT nobody listens on (plus the case's own variables)."""
    e = env()
    e.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    e.update(extra_env or {})
    return e


def _assert_one_message(lines: list[str], expected: str, stderr: str) -> None:
    """stderr is the refusal and nothing else: one line, or (several problems found in one pass)
    a first line that counts them and one line per problem."""
    assert lines and lines[0].startswith("harness: error: "), stderr[-2000:]
    if len(lines) > 1:
        assert lines[0].endswith(f"{len(lines) - 1} problems:") and all(ln.startswith("  - ") for ln in lines[1:]), stderr[-2000:]
    assert any(expected in ln for ln in lines), lines


@pytest.mark.parametrize("name, extra_env, args, expected", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_fails_before_any_process_group(ws, tmp_path, monkeypatch, capfd, name, extra_env, args, expected):
    import harness.train  # here, not at collection: `pytest -m "not integration"` need not import the trainer

    before = _snapshot(ws["done"])
    argv, out = _case_argv(ws, tmp_path / f"case-{name}", args)
    code, stderr, shown = call_entry_point(harness.train.main, argv, _launch_env(extra_env), monkeypatch, capfd)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, (code, stderr[-2000:])
    _assert_one_message(lines, expected, stderr)
    assert not shown, [f"{w.category.__name__}: {w.message}" for w in shown]  # a process would print them on stderr
    assert not torch.distributed.is_initialized()
    assert not out.exists(), "a failed pre-flight wrote into the output directory"
    assert _snapshot(ws["done"]) == before, "a failed pre-flight touched an existing run's files"


# Also run as processes (each a fresh interpreter: ~10 s of CPU on the CI machine): one decided by
# the launcher's environment alone, and one that imports DeepSpeed (whose import logs the most).
PROCESS_CASES = ["accelerate_precision_disagrees", "ds_misspelt_top_level_key"]


def _run_case(ws, tmp, extra_env, args) -> tuple[subprocess.CompletedProcess, bool]:
    argv, out = _case_argv(ws, tmp, args)
    proc = subprocess.run(
        [sys.executable, "-m", "harness.train", *argv],
        cwd=REPO,
        env=_launch_env(extra_env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return proc, out.exists()


@pytest.fixture(scope="module")
def processes(ws):
    """The PROCESS_CASES side by side (each is a fresh interpreter importing torch: seconds of CPU)."""
    from concurrent.futures import ThreadPoolExecutor

    before = _snapshot(ws["done"])
    cases = {_id(c): (c.values if hasattr(c, "values") else c) for c in CASES}
    with ThreadPoolExecutor(max_workers=len(PROCESS_CASES)) as pool:
        futures = {n: pool.submit(_run_case, ws, ws["root"] / f"process-{n}", *cases[n][1:3]) for n in PROCESS_CASES}
        out = {n: f.result() for n, f in futures.items()}
    return out, _snapshot(ws["done"]) == before


@pytest.mark.parametrize("name", PROCESS_CASES)
def test_bad_input_fails_before_any_process_group_as_a_process(processes, name):
    expected = next((c.values if hasattr(c, "values") else c)[3] for c in CASES if _id(c) == name)
    by_case, untouched = processes
    proc, wrote = by_case[name]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    _assert_one_message(lines, expected, proc.stderr)
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
