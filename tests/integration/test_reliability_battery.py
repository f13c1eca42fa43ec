"""The reliability battery: each case a real input a hostile or an ordinary user gives, its one
line and documented exit code, and nothing of the user's changed (every file hashed before and after).

Classes (notes/reliability.md counts them): 1 data loss (export targets, resume that would
overwrite or delete checkpoints, the prune command over a training directory); 2 hangs (a rank
outside the world); 3 a traceback where one line is promised (damaged checkpoints on resume and
export, a changed architecture, vocabulary, tokenizer or ZeRO stage, missing shards, broken
tokenizers, garbage launcher variables and `HARNESS_*` knobs, bad config files, plan output
paths); 4 silent wrong results (a lowered learning rate on resume; every step skipped).

Entry points run in this interpreter (`launching.call_entry_point`): `init_distributed` is
replaced by a failure, so a case that gets past pre-flight fails at once instead of waiting.
One real run (world 1, checkpoints at steps 2 and 4) is what the checkpoint cases damage copies of.
The cases that need real processes (a lowered LR, all steps non-finite, Ctrl-C) run at once in
one fixture. The in-process rest of the battery: tests/unit/test_reliability_units.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launching import REPO, call_entry_point, env, run, step_losses, tiny_config

from harness.models import build_model


def digest(path: Path) -> dict[str, str]:
    """Content hash of every file under `path` (or of `path`): what "nothing changed" is checked against."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def ws(tmp_path_factory, data_cache, tokenizer_dir):
    root = tmp_path_factory.mktemp("battery")
    done = root / "done"
    cfg = tiny_config(root / "done.yaml", data_cache, done, steps=4, **{"checkpoint.every": 2, "checkpoint.keep": 3})
    run([sys.executable, "-m", "harness.train", "--config", str(cfg)])
    user = root / "user_dir"
    (user / "notes").mkdir(parents=True)
    (user / "README.md").write_text("my notes\n")
    (user / "notes" / "a.txt").write_text("precious\n")
    (root / "a_file").write_text("a file\n")
    model = build_model("tiny-llama", vocab_size=512, seed=0)
    model.save_pretrained(root / "model", safe_serialization=True)
    shutil.copy(Path(tokenizer_dir) / "tokenizer.json", root / "model" / "tokenizer.json")
    return {"root": root, "done": done, "cache": data_cache, "tok": Path(tokenizer_dir), "user": user}


def ckpt(ws, step: int) -> Path:
    return ws["done"] / "checkpoints" / f"step_{step:08d}"


def one_line(code, stderr: str, want_code: int, expected: str, prog: str = "harness") -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("[harness]")]
    assert code == want_code, (code, stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), stderr[-3000:]
    assert expected in lines[0], lines[0]
    return lines[0]


def world1() -> dict[str, str]:
    return env()


def train(ws, tmp: Path, monkeypatch, capfd, overrides, out: Path | None = None, launch=None, config: Path | None = None, **cfg):
    import harness.train

    out = out or tmp / "out"
    config = config or tiny_config(tmp / "run.yaml", ws["cache"], out, steps=4, **{"checkpoint.every": 2, **cfg})
    code, stderr, _ = call_entry_point(harness.train.main, ["--config", str(config), *overrides], launch or world1(), monkeypatch, capfd)
    return code, stderr


# ------------------------------------------------------------------ class 1: data loss


RESUME_LOSS = [  # (id, overrides, expected)
    ("auto_steps_below_checkpoint", ["checkpoint.resume=auto", "steps=3"], "is at step 4 but this run ends at step 3"),
    ("auto_steps_one", ["checkpoint.resume=auto", "steps=1"], "set steps >= 4 to continue it"),
    ("path_steps_below_checkpoint", ["checkpoint.resume={c4}", "steps=2"], "its later weights would be saved under an earlier"),
    ("older_checkpoint_drops_later", ["checkpoint.resume={c2}"], "would abandon this run's later checkpoints (step_00000004)"),
    ("older_checkpoint_same_steps", ["checkpoint.resume={c2}", "steps=2"], "checkpoint.overwrite=true to delete step_00000004"),
    ("older_checkpoint_longer_run", ["checkpoint.resume={c2}", "steps=8"], "resume from the latest (checkpoint.resume=auto)"),
]


@pytest.mark.parametrize("name, overrides, expected", RESUME_LOSS, ids=[c[0] for c in RESUME_LOSS])
def test_class1_resume_never_overwrites_or_deletes_checkpoints(ws, tmp_path, monkeypatch, capfd, name, overrides, expected):
    before = digest(ws["done"])
    fill = {"c2": ckpt(ws, 2), "c4": ckpt(ws, 4)}
    code, stderr = train(ws, tmp_path, monkeypatch, capfd, [o.format(**fill) for o in overrides], out=ws["done"])
    one_line(code, stderr, 2, expected)
    assert digest(ws["done"]) == before


def test_class1_an_older_checkpoint_with_the_explicit_flag_passes_preflight(ws, tmp_path):
    """checkpoint.overwrite=true is the explicit choice: pre-flight lets the resume through."""
    from harness.config import load_config, load_strategy
    from harness.runner import preflight

    config = tiny_config(tmp_path / "run.yaml", ws["cache"], ws["done"], steps=4)
    cfg = load_config(str(config), [f"checkpoint.resume={ckpt(ws, 2)}", "checkpoint.overwrite=true"])
    assert preflight(cfg, load_strategy(cfg.strategy)).strategy.kind == "ddp"


def _fake_export(path: Path, extra: str | None = None) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / ".harness-export").write_text(json.dumps({"checkpoint": "x", "files": ["config.json"]}))
    if extra:
        (path / extra).write_text("the user's\n")


RUN_EXPORTS = [  # (id, what is in <output_dir>/<dir>, overrides, expected)
    ("hf_holds_user_files", "hf", "user", ["checkpoint.export_hf=true"], "is not an export written by harness"),
    ("hf_is_a_file", "hf", "file", ["checkpoint.export_hf=true"], "exists and is not a directory"),
    ("hf_earlier_export_fresh_run", "hf", "export", ["checkpoint.export_hf=true"], "set checkpoint.overwrite=true (or"),
    ("hf_export_plus_user_file", "hf", "export+user", ["checkpoint.export_hf=true", "checkpoint.overwrite=true"], "not an export"),
    ("adapter_holds_user_files", "adapter", "user", ["lora.enabled=true"], "is not an export written by harness"),
]


@pytest.mark.parametrize("name, sub, kind, overrides, expected", RUN_EXPORTS, ids=[c[0] for c in RUN_EXPORTS])
def test_class1_a_runs_export_never_replaces_what_harness_did_not_write(
    ws, tmp_path, monkeypatch, capfd, name, sub, kind, overrides, expected
):
    out = tmp_path / "out"
    target = out / sub
    if kind == "user":
        shutil.copytree(ws["user"], target)
    elif kind == "file":
        out.mkdir()
        target.write_text("a file\n")
    else:
        _fake_export(target, "mine.txt" if kind == "export+user" else None)
    before = digest(out)
    code, stderr = train(ws, tmp_path, monkeypatch, capfd, overrides, out=out)
    one_line(code, stderr, 2, expected)
    assert digest(out) == before


PRUNE_OUT = [  # (id, output_dir setup, overrides, expected)
    ("training_run_directory", "done", [], "holds another run's outputs (checkpoints, metrics.jsonl)"),
    ("directory_with_hf_only", "hf", [], "set output_dir to a new directory"),
    ("directory_with_metrics_only", "metrics", [], "or checkpoint.overwrite=true to replace them"),
    ("model_inside_output_dir", "model_inside", ["checkpoint.overwrite=true"], "lies inside output_dir"),
]


@pytest.mark.parametrize("name, setup, overrides, expected", PRUNE_OUT, ids=[c[0] for c in PRUNE_OUT])
def test_class1_prune_never_writes_over_a_training_directory(ws, tmp_path, monkeypatch, capfd, name, setup, overrides, expected):
    import harness.prune

    out = tmp_path / "out"
    model = f"model.name={ws['root'] / 'model'}"
    if setup == "done":
        out = ws["done"]
    elif setup == "hf":
        _fake_export(out / "hf")
    elif setup == "metrics":
        out.mkdir()
        (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    else:
        shutil.copytree(ws["root"] / "model", out / "hf")
        model = f"model.name={out / 'hf'}"
    before = digest(out)
    config = tiny_config(tmp_path / "p.yaml", ws["cache"], out, **{"prune.method": "magnitude"})
    code, stderr, _ = call_entry_point(harness.prune.main, ["--config", str(config), model, *overrides], world1(), monkeypatch, capfd)
    line = one_line(code, stderr, 2, expected, "harness.prune")
    assert "resume=auto" not in line  # advice the prune command accepts (it refuses resume)
    assert digest(out) == before


EXPORT_TARGETS = [  # (id, --out, flags, expected)
    ("user_directory", "{user}", [], "is not an export written by harness (2 entries: README.md, notes)"),
    ("user_directory_with_overwrite", "{user}", ["--overwrite"], "nothing in it is deleted"),
    ("the_run_directory", "{done}", [], "contains or lies inside the checkpoint being exported"),
    ("the_run_directory_with_overwrite", "{done}", ["--overwrite"], "contains or lies inside the checkpoint"),
    ("the_checkpoints_directory", "{done}/checkpoints", ["--overwrite"], "contains or lies inside the checkpoint"),
    ("the_checkpoint_itself", "{c4}", ["--overwrite"], "contains or lies inside the checkpoint"),
    ("inside_the_checkpoint", "{c4}/hf_config", ["--overwrite"], "contains or lies inside the checkpoint"),
    ("an_existing_file", "{root}/a_file", ["--overwrite"], "exists and is not a directory"),
    ("earlier_export_without_flag", "{export}", [], "holds an earlier harness export; set --overwrite"),
    ("earlier_export_plus_user_file", "{export_user}", ["--overwrite"], "is not an export written by harness"),
    ("symlink_to_user_directory", "{link}", ["--overwrite"], "exists and is not a directory"),
    ("user_notes_subdirectory", "{user}/notes", ["--overwrite"], "(1 entries: a.txt)"),
]


@pytest.mark.parametrize("name, out, flags, expected", EXPORT_TARGETS, ids=[c[0] for c in EXPORT_TARGETS])
def test_class1_export_never_deletes_a_target_it_did_not_write(ws, tmp_path, monkeypatch, capfd, name, out, flags, expected):
    import harness.export

    _fake_export(tmp_path / "export")
    _fake_export(tmp_path / "export_user", "mine.txt")
    (tmp_path / "link").symlink_to(ws["user"])
    fill = {
        "user": ws["user"],
        "done": ws["done"],
        "c4": ckpt(ws, 4),
        "root": ws["root"],
        **{k: tmp_path / k for k in ("export", "export_user", "link")},
    }
    before = digest(ws["root"]), digest(tmp_path)
    code, stderr, _ = call_entry_point(
        harness.export.main, [str(ws["done"]), "--out", out.format(**fill), *flags], world1(), monkeypatch, capfd
    )
    one_line(code, stderr, 2, expected, "harness.export")
    assert (digest(ws["root"]), digest(tmp_path)) == before


def test_class1_export_recovers_replaces_only_its_own_and_leaves_the_users_tmp(ws, tmp_path, monkeypatch, capfd):
    """Recovered: an export next to a user's `<out>.tmp` (once deleted) leaves it; into an empty
    directory works; again with --overwrite replaces the earlier export (and only it)."""
    import harness.export

    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.tmp" / "keep.txt").write_text("the user's\n")
    (tmp_path / "hf").mkdir()
    users = digest(tmp_path / "hf.tmp")
    argv = [str(ckpt(ws, 4)), "--out", str(tmp_path / "hf")]
    code, _, _ = call_entry_point(harness.export.main, argv, world1(), monkeypatch, capfd)
    assert code == 0 and (tmp_path / "hf" / "model.safetensors").is_file()
    first = digest(tmp_path / "hf")
    code, _, _ = call_entry_point(harness.export.main, [*argv, "--overwrite"], world1(), monkeypatch, capfd)
    assert code == 0 and digest(tmp_path / "hf").keys() == first.keys()
    assert digest(tmp_path / "hf.tmp") == users
    assert not [p for p in tmp_path.iterdir() if "harness-tmp" in p.name]  # no temporary directory left


# ------------------------------------------------------------------ class 3: damaged checkpoints


DAMAGE = [  # (id, damage, expected text: the file it names)
    ("shard_truncated", ("truncate", "dcp/__0_0.distcp"), "__0_0.distcp' has"),
    ("shard_missing", ("delete", "dcp/__0_0.distcp"), "__0_0.distcp' is missing"),
    ("dcp_metadata_emptied", ("truncate0", "dcp/.metadata"), ".metadata' has 0 bytes"),
    ("trainer_state_missing", ("delete", "trainer_state.pt"), "trainer_state.pt' is missing"),
    ("rng_state_truncated", ("truncate", "rng/rank00000.pt"), "rank00000.pt' has"),
    ("tokenizer_file_missing", ("delete", os.path.join("hf_config", "tokenizer.json")), "tokenizer.json' is missing"),
    ("meta_json_garbage", ("write", "meta.json", b"{not json"), "meta.json' is unreadable"),
    ("meta_json_not_utf8", ("write", "meta.json", b'{"step": "\xff"}'), "meta.json' is unreadable"),
    ("meta_json_wrong_keys", ("write", "meta.json", b'{"stepp": 4}'), "meta.json' is unreadable"),
    ("meta_json_missing", ("delete", "meta.json"), "holds no complete checkpoint"),
]


def _damaged(ws, tmp: Path, damage) -> Path:
    copy = tmp / "ckpt" / "step_00000004"
    shutil.copytree(ckpt(ws, 4), copy)
    kind, name, *data = damage
    target = copy / name
    if kind == "delete":
        target.unlink()
    elif kind == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif kind == "truncate0":
        target.write_bytes(b"")
    else:
        target.write_bytes(data[0])
    return copy


@pytest.mark.parametrize("name, damage, expected", DAMAGE, ids=[c[0] for c in DAMAGE])
def test_class3_a_damaged_checkpoint_on_resume_is_exit_6_naming_the_file(ws, tmp_path, monkeypatch, capfd, name, damage, expected):
    copy = _damaged(ws, tmp_path, damage)
    code, stderr = train(ws, tmp_path, monkeypatch, capfd, [f"checkpoint.resume={copy}", "steps=6"])
    one_line(code, stderr, 6, expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, damage, expected", DAMAGE, ids=[c[0] for c in DAMAGE])
def test_class3_a_damaged_checkpoint_on_export_is_exit_6_naming_the_file(ws, tmp_path, monkeypatch, capfd, name, damage, expected):
    import harness.export

    copy = _damaged(ws, tmp_path, damage)
    code, stderr, _ = call_entry_point(harness.export.main, [str(copy), "--out", str(tmp_path / "hf")], world1(), monkeypatch, capfd)
    one_line(code, stderr, 6, expected, "harness.export")
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if "harness-tmp" in p.name]


def test_class3_bytes_corrupted_at_the_right_size_are_exit_6_on_export(ws, tmp_path, monkeypatch, capfd):
    """The manifest cannot see a flipped byte; the reader's failure is still one line, exit 6."""
    import harness.export

    copy = _damaged(ws, tmp_path, ("write", "dcp/.metadata", os.urandom((ckpt(ws, 4) / "dcp" / ".metadata").stat().st_size)))
    code, stderr, _ = call_entry_point(harness.export.main, [str(copy), "--out", str(tmp_path / "hf")], world1(), monkeypatch, capfd)
    one_line(code, stderr, 6, "could not be read: ", "harness.export")


def test_class3_bytes_corrupted_at_the_right_size_name_the_file_on_resume(ws, tmp_path):
    from harness.checkpoint.layout import read_file
    from harness.errors import CheckpointError

    copy = _damaged(ws, tmp_path, ("write", "trainer_state.pt", os.urandom((ckpt(ws, 4) / "trainer_state.pt").stat().st_size)))
    with pytest.raises(CheckpointError, match="trainer_state.pt' is corrupt"):
        read_file(str(copy / "trainer_state.pt"))


# ------------------------------------------------------------------ class 3: what changed since the checkpoint


def _model_dir(ws, tmp: Path, **changes) -> Path:
    model = tmp / "model"
    shutil.copytree(ws["root"] / "model", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return model


def _checkpoint_of(ws, tmp: Path, **meta_changes) -> Path:
    copy = tmp / "ckpt" / "step_00000004"
    shutil.copytree(ckpt(ws, 4), copy)
    meta = json.loads((copy / "meta.json").read_text())
    for key, value in meta_changes.items():
        meta[key] = value
    (copy / "meta.json").write_text(json.dumps(meta))
    return copy


CHANGED = [  # (id, model config change, meta change, overrides, expected)
    # the directory's config.json against its own weights, refused in pre-flight before the checkpoint is read
    ("hidden_size", {"hidden_size": 96}, {}, [], "has shape [512, 64], the model expects [512, 96]"),
    ("layers", {"num_hidden_layers": 3}, {}, [], "num_hidden_layers=2"),
    ("heads", {"num_attention_heads": 8}, {}, [], "self_attn.q_proj.weight in"),
    ("model_vocabulary", {"vocab_size": 1024}, {}, [], "has shape [512, 64], the model expects [1024, 64]"),
    ("bpe_vocabulary", None, {}, ["data.vocab_size=1024"], "data.vocab_size=512 but this run has 1024"),
    ("tokenizer", None, {}, ["data.tokenizer={tok}"], "data.tokenizer=None"),
    (
        "zero_stage_2_to_3",
        None,
        {"kind": "deepspeed", "engine": "deepspeed", "strategy": "zero2", "zero_stage": 2},
        ["strategy=zero3"],
        "ZeRO stage 2 (zero2) but this run uses stage 3 (zero3)",
    ),
    (
        "zero_stage_1_to_2",
        None,
        {"kind": "deepspeed", "engine": "deepspeed", "strategy": "zero1", "zero_stage": 1},
        ["strategy=zero2"],
        "ZeRO stage 1 (zero1) but this run uses stage 2",
    ),
]


@pytest.mark.parametrize("name, model_change, meta_change, overrides, expected", CHANGED, ids=[c[0] for c in CHANGED])
def test_class3_resume_after_a_change_is_refused_naming_both_values(
    ws, tmp_path, monkeypatch, capfd, name, model_change, meta_change, overrides, expected
):
    extra = []
    if model_change is not None:
        model = _model_dir(ws, tmp_path, **model_change)
        # the checkpoint was trained from this directory (before it changed): its hf_config is the original
        meta_change = {**meta_change, "model": str(model)}
        extra = [f"model.name={model}"]
    copy = _checkpoint_of(ws, tmp_path, **meta_change)
    if model_change is not None:
        meta = json.loads((copy / "meta.json").read_text())
        meta["config"]["model"]["name"] = str(model)
        (copy / "meta.json").write_text(json.dumps(meta))  # its hf_config is the preset's: the model directory before it changed
    code, stderr = train(
        ws, tmp_path, monkeypatch, capfd, [f"checkpoint.resume={copy}", *extra, *[o.format(tok=ws["tok"]) for o in overrides]]
    )
    one_line(code, stderr, 2, expected)


# ------------------------------------------------------------------ class 3: model, tokenizer, data cache, config files


def _bad_model(ws, tmp: Path, kind: str) -> Path:
    model = tmp / "m"
    shutil.copytree(ws["root"] / "model", model)
    if kind.startswith("index"):
        (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
        index = {
            "metadata": {},
            "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors", "model.norm.weight": "model-00002-of-00002.safetensors"},
        }
        text = {"index_missing_shard": json.dumps(index), "index_not_json": "{", "index_no_weight_map": json.dumps({"metadata": {}})}[kind]
        (model / "model.safetensors.index.json").write_text(text)
    elif kind == "tokenizer_json_garbage":
        (model / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    return model


MODEL_FILES = [  # (id, setup, overrides, expected)
    ("index_missing_shard", "index_missing_shard", [], "names 1 shard(s) missing"),
    ("index_not_json", "index_not_json", [], "is not a valid shard index"),
    ("index_no_weight_map", "index_no_weight_map", [], "is not a valid shard index (KeyError)"),
    ("model_tokenizer_broken", "tokenizer_json_garbage", [], "cannot be read as a tokenizer"),
    ("tokenizer_dir_empty", "tok_empty", [], "holds no tokenizer"),
    ("tokenizer_json_truncated", "tok_truncated", [], "cannot be read as a tokenizer"),
    ("tokenizer_config_not_json", "tok_config", [], "tokenizer_config.json' is not valid JSON"),
    ("cache_dir_under_a_file", "cache_file", [], "is a file; set data.cache_dir"),
]


@pytest.mark.parametrize("name, setup, overrides, expected", MODEL_FILES, ids=[c[0] for c in MODEL_FILES])
def test_class3_broken_model_tokenizer_and_cache_paths_are_one_line(ws, tmp_path, monkeypatch, capfd, name, setup, overrides, expected):
    args = []
    if setup.startswith(("index", "tokenizer_json")):
        args = [f"model.name={_bad_model(ws, tmp_path, setup)}"]
    elif setup.startswith("tok_"):
        tok = tmp_path / "tok"
        tok.mkdir()
        if setup != "tok_empty":
            shutil.copytree(ws["tok"], tok, dirs_exist_ok=True)
        if setup == "tok_truncated":
            (tok / "tokenizer.json").write_text((ws["tok"] / "tokenizer.json").read_text()[:500])
        if setup == "tok_config":
            (tok / "tokenizer_config.json").write_text("{'single': 'quotes'}")
        args = [f"data.tokenizer={tok}"]
    else:
        (tmp_path / "afile").write_text("x")
        args = [f"data.cache_dir={tmp_path / 'afile' / 'cache'}", "data.vocab_size=300"]
    before = digest(tmp_path)
    code, stderr = train(ws, tmp_path, monkeypatch, capfd, [*args, *overrides])
    one_line(code, stderr, 2, expected)
    after = digest(tmp_path)
    assert {k: v for k, v in after.items() if "run.yaml" not in k} == {k: v for k, v in before.items() if "run.yaml" not in k}


CONFIG_FILES = [  # (id, file name, bytes, expected)
    ("yaml_duplicate_top_key", "c.yaml", b"steps: 3\nsteps: 4\n", "key 'steps' is given twice"),
    ("yaml_duplicate_nested_key", "c.yaml", b"optim:\n  lr: 0.1\n  lr: 0.2\n", "key 'lr' is given twice"),
    ("json_duplicate_key", "c.json", b'{"steps": 3, "steps": 4}', "key 'steps' is given twice"),
    ("json_duplicate_nested_key", "c.json", b'{"optim": {"lr": 0.1, "lr": 0.2}}', "key 'lr' is given twice"),
    ("yaml_latin1", "c.yaml", "logging:\n  run_name: caf\u00e9\n".encode("latin-1"), "not UTF-8 text (line 2"),
    ("json_utf16", "c.json", '{"steps": 3}'.encode("utf-16"), "not UTF-8 text (line 1"),
    ("config_is_a_directory", "adir", None, "not found"),
    ("yaml_section_given_twice", "c.yaml", b"optim:\n  lr: 0.1\noptim:\n  eps: 1.0e-8\n", "key 'optim' is given twice"),
    ("json_latin1", "c.json", '{"logging": {"run_name": "caf\u00e9"}}'.encode("latin-1"), "not UTF-8 text (line 1"),
]


@pytest.mark.parametrize("name, file, data, expected", CONFIG_FILES, ids=[c[0] for c in CONFIG_FILES])
def test_class3_bad_config_files_are_one_line(ws, tmp_path, monkeypatch, capfd, name, file, data, expected):
    path = tmp_path / file
    path.mkdir() if data is None else path.write_bytes(data)
    code, stderr = train(ws, tmp_path, monkeypatch, capfd, [], config=path)
    one_line(code, stderr, 2, expected)


# ------------------------------------------------------------------ classes 2 and 3: the launcher's variables, harness's knobs


LAUNCH = [  # (id, class, variables, expected)
    ("rank_equals_world", 2, {"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 of a world of 2 (ranks are 0..1)"),
    ("rank_beyond_world", 2, {"RANK": "7", "WORLD_SIZE": "4"}, "rank 7 of a world of 4"),
    ("slurm_procid_beyond_ntasks", 2, {"SLURM_PROCID": "3", "SLURM_NTASKS": "2", "MASTER_ADDR": "127.0.0.1"}, "rank 3 of a world of 2"),
    ("rank_not_a_number", 3, {"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer"),
    ("rank_negative", 3, {"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 must be >= 0"),
    ("world_zero", 3, {"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ("world_word", 3, {"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ("world_float", 3, {"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0' is not an integer"),
    ("local_rank_word", 3, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
    ("local_rank_negative", 3, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-3"}, "LOCAL_RANK=-3 must be >= 0"),
    ("master_port_word", 3, {"MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ("master_port_zero", 3, {"MASTER_PORT": "0"}, "MASTER_PORT=0 must be between 1 and 65535"),
    ("master_port_too_high", 3, {"MASTER_PORT": "70000"}, "MASTER_PORT=70000 must be between 1 and 65535"),
    ("master_addr_empty", 3, {"MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
    ("slurm_ntasks_zero", 3, {"SLURM_PROCID": "0", "SLURM_NTASKS": "0", "MASTER_ADDR": "127.0.0.1"}, "SLURM_NTASKS=0 must be >= 1"),
    ("slurm_procid_word", 3, {"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "MASTER_ADDR": "127.0.0.1"}, "SLURM_PROCID='x'"),
    ("slurm_localid_word", 3, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "y", "MASTER_ADDR": "h"}, "SLURM_LOCALID='y'"),
    ("collective_timeout_word", 3, {"HARNESS_COLLECTIVE_TIMEOUT_S": "abc"}, "HARNESS_COLLECTIVE_TIMEOUT_S='abc' is not a number"),
    ("collective_timeout_zero", 3, {"HARNESS_COLLECTIVE_TIMEOUT_S": "0"}, "must be a positive, finite number"),
    ("collective_timeout_negative", 3, {"HARNESS_COLLECTIVE_TIMEOUT_S": "-5"}, "must be a positive, finite number"),
    ("collective_timeout_inf", 3, {"HARNESS_COLLECTIVE_TIMEOUT_S": "inf"}, "must be a positive, finite number"),
    ("collective_timeout_nan", 3, {"HARNESS_COLLECTIVE_TIMEOUT_S": "nan"}, "must be a positive, finite number"),
    ("peer_timeout_word", 3, {"HARNESS_PEER_TIMEOUT_S": "30s"}, "HARNESS_PEER_TIMEOUT_S='30s' is not a number"),
    ("peer_timeout_zero", 3, {"HARNESS_PEER_TIMEOUT_S": "0"}, "HARNESS_PEER_TIMEOUT_S='0' must be"),
    ("lock_stale_negative", 3, {"HARNESS_LOCK_STALE_S": "-1"}, "HARNESS_LOCK_STALE_S='-1' must be"),
    ("build_lock_stale_word", 3, {"HARNESS_BUILD_LOCK_STALE_S": "five"}, "HARNESS_BUILD_LOCK_STALE_S='five'"),
    ("build_lock_wait_zero", 3, {"HARNESS_BUILD_LOCK_WAIT_S": "0"}, "HARNESS_BUILD_LOCK_WAIT_S='0' must be"),
    ("log_level_unknown", 3, {"HARNESS_LOG_LEVEL": "LOUD"}, "HARNESS_LOG_LEVEL='LOUD' is not one of DEBUG"),
    ("fault_step_word", 3, {"HARNESS_FAULT": "nan_loss@x"}, "HARNESS_FAULT item 'nan_loss@x'"),
    ("fault_seconds_word", 3, {"HARNESS_FAULT": "save_pause=abc@2"}, "HARNESS_FAULT item 'save_pause=abc@2'"),
    ("fault_rank_word", 3, {"HARNESS_FAULT": "signal@3:one"}, "HARNESS_FAULT item 'signal@3:one'"),
    ("ds_cpu_adam_word", 3, {"HARNESS_DS_CPU_ADAM": "yes"}, "HARNESS_DS_CPU_ADAM='yes' must be 0 or 1"),
    ("ds_cpu_adam_two", 3, {"HARNESS_DS_CPU_ADAM": "2"}, "HARNESS_DS_CPU_ADAM='2' must be 0 or 1"),
    ("rank_float", 3, {"RANK": "0.0", "WORLD_SIZE": "2"}, "RANK='0.0' is not an integer"),
    ("world_negative", 3, {"RANK": "0", "WORLD_SIZE": "-2"}, "WORLD_SIZE=-2 must be >= 1"),
    ("master_port_negative", 3, {"MASTER_PORT": "-1"}, "MASTER_PORT=-1 must be between 1 and 65535"),
    ("local_rank_float", 3, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1.5"}, "LOCAL_RANK='1.5' is not an integer"),
    ("lock_stale_with_unit", 3, {"HARNESS_LOCK_STALE_S": "2m"}, "HARNESS_LOCK_STALE_S='2m' is not a number of seconds"),
    ("peer_timeout_inf", 3, {"HARNESS_PEER_TIMEOUT_S": "inf"}, "must be a positive, finite number"),
    ("log_level_number", 3, {"HARNESS_LOG_LEVEL": "10"}, "HARNESS_LOG_LEVEL='10' is not one of"),
]


@pytest.mark.parametrize("name, klass, variables, expected", LAUNCH, ids=[c[0] for c in LAUNCH])
def test_class2_3_launcher_variables_and_knobs_are_checked_before_any_wait(
    ws, tmp_path, monkeypatch, capfd, name, klass, variables, expected
):
    launch = {**env(), **variables}
    code, stderr = train(ws, tmp_path, monkeypatch, capfd, [], launch=launch)
    one_line(code, stderr, 2, expected)
    assert not (tmp_path / "out").exists() and not torch.distributed.is_initialized()


PLAN_OUT = [  # (id, flag, target, expected)
    ("json_into_a_directory", "--json", "{dir}", "is a directory; give a file name"),
    ("json_missing_directory", "--json", "{dir}/no/such/plan.json", "does not exist (or is a file)"),
    ("json_under_a_file", "--json", "{file}/plan.json", "does not exist (or is a file)"),
    ("recommend_out_a_directory", "--out", "{dir}", "is a directory; give a file name"),
]


@pytest.mark.parametrize("name, flag, target, expected", PLAN_OUT, ids=[c[0] for c in PLAN_OUT])
def test_class3_plan_output_paths_are_checked_first(ws, tmp_path, monkeypatch, capfd, name, flag, target, expected):
    import harness.plan

    (tmp_path / "file").write_text("x")
    argv = ["--gpu-mem", "8GiB", flag, target.format(dir=tmp_path, file=tmp_path / "file")]
    before = digest(tmp_path)
    code, stderr, _ = call_entry_point(harness.plan.main, argv, world1(), monkeypatch, capfd)
    one_line(code, stderr, 2, expected, "harness.plan")
    assert digest(tmp_path) == before


# ------------------------------------------------------------------ real processes: classes 2 and 4


def _start(cmd: list[str], extra: dict[str, str] | None = None, logs: Path | None = None) -> subprocess.Popen:
    """A process with pipes, or (`logs`) with its stdout and stderr in files read while it runs."""
    e = env()
    e.update(extra or {})
    if logs is None:
        return subprocess.Popen(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=open(f"{logs}.out", "w"), stderr=open(f"{logs}.err", "w"), text=True)
    proc.logs = logs  # type: ignore[attr-defined]
    return proc


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[subprocess.Popen, str, str]:
    proc.wait(timeout=timeout)
    return proc, Path(f"{proc.logs}.out").read_text(), Path(f"{proc.logs}.err").read_text()


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and pattern in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} never appeared in {path}")


@pytest.fixture(scope="module")
def processes(ws, tmp_path_factory):
    """Three real runs at once (world 1 each, on 2 cores): a lowered LR on resume, every step NaN,
    and Ctrl-C once two steps are logged."""
    root = tmp_path_factory.mktemp("procs")
    lowered = root / "lowered"
    shutil.copytree(ws["done"], lowered)
    cfg = tiny_config(root / "lr.yaml", ws["cache"], lowered, steps=6, **{"checkpoint.every": 2})
    nan_cfg = tiny_config(root / "nan.yaml", ws["cache"], root / "nan", steps=1)
    ctrlc_out = root / "ctrlc"
    ctrlc_cfg = tiny_config(root / "c.yaml", ws["cache"], ctrlc_out, steps=400, **{"logging.log_every": 1})
    ctrlc = _start([sys.executable, "-m", "harness.train", "--config", str(ctrlc_cfg)], logs=root / "ctrlc")
    resume = _start(
        [sys.executable, "-m", "harness.train", "--config", str(cfg), "checkpoint.resume=auto", "optim.lr=0.001"], logs=root / "lr"
    )
    nans = _start([sys.executable, "-m", "harness.train", "--config", str(nan_cfg)], {"HARNESS_FAULT": "nan_loss@1"}, logs=root / "nan")
    _wait_for(ctrlc_out / "metrics.jsonl", '"step": 2', ctrlc)
    ctrlc.send_signal(signal.SIGINT)
    out = {"ctrlc": _finish(ctrlc, 120), "resume": _finish(resume, 240), "nan": _finish(nans, 240)}
    return {"out": out, "root": root, "lowered": lowered, "ctrlc": ctrlc_out}


def test_class4_a_lowered_lr_on_resume_is_honoured_and_said(processes):
    proc, stdout, stderr = processes["out"]["resume"]
    assert proc.returncode == 0, stderr[-3000:]
    assert "optim.lr changed from 0.01 to 0.001: the schedule continues from step 4 at the new rate" in stderr
    rows = [json.loads(x) for x in (processes["lowered"] / "metrics.jsonl").read_text().splitlines() if x.strip()]
    lrs = {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}
    from harness.config import OptimConfig
    from harness.training import lr_lambda

    factor = lr_lambda(OptimConfig(lr=0.001, warmup_steps=1), 6)
    assert lrs[5] == pytest.approx(0.001 * factor(4), rel=1e-6) and lrs[6] == pytest.approx(0.001 * factor(5), rel=1e-6)
    assert lrs[4] == pytest.approx(0.01 * lr_lambda(OptimConfig(lr=0.01, warmup_steps=1), 4)(3), rel=1e-6)  # before: the old rate


def test_class4_a_run_whose_every_step_is_skipped_exits_3(processes):
    proc, stdout, stderr = processes["out"]["nan"]
    assert proc.returncode == 3, (proc.returncode, stderr[-3000:])
    assert "update skipped" in stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("harness: error:")]
    assert len(errors) == 1 and "the model did not train" in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr


def test_class4_ctrl_c_stops_at_a_step_boundary_with_a_checkpoint(processes):
    proc, stdout, stderr = processes["out"]["ctrlc"]
    assert proc.returncode == 0, stderr[-3000:]
    assert "Ctrl-C: stopping at the next step boundary" in stderr and "Traceback" not in stderr
    assert "stop requested (SIGTERM/SIGUSR1/Ctrl-C): saved" in stdout
    saved = sorted((processes["ctrlc"] / "checkpoints").glob("step_*"))
    assert saved and len(step_losses(processes["ctrlc"])) == int(saved[-1].name.split("_")[1])
