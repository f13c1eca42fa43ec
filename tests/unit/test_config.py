"""Run config: YAML/JSON loading, dotted overrides, typed values, unknown-key suggestions."""

import json

import pytest

from harness.config import all_keys, check_run, default_lr, is_given, load_config, load_strategy
from harness.errors import ConfigError
from harness.runner.build import describe_lr


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: tiny-llama\noptim:\n  lr: 0.01\nsteps: 7\n")
    cfg = load_config(str(path), ["optim.lr=0.5", "memory.activation_checkpointing=full", "optim.betas=[0.8,0.9]"])
    assert cfg.steps == 7
    assert cfg.optim.lr == 0.5
    assert cfg.memory.activation_checkpointing == "full"
    assert cfg.optim.betas == (0.8, 0.9)


def test_json_config(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"precision": "bf16", "data": {"seq_len": 64}}))
    cfg = load_config(str(path))
    assert cfg.precision == "bf16" and cfg.data.seq_len == 64


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "did you mean 'optim.lr'"),
        ("stepz=3", "did you mean 'steps'"),
        ("steps=abc", "expected int"),
        ("precision=bf17", "did you mean 'bf16'"),
        ("memory.activation_memory_budget=1.5", "must be in [0, 1]"),
        ("prune.sparsity=1.0", "must be in [0, 1)"),
        ("prune.pattern=4:2", "0 < N < M"),
        ("micro_batch_size=0", "must be >= 1"),
        ("no_equals_sign", "not key=value"),
    ],
)
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_key_in_file_suggests_closest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  warmup_step: 3\n")
    with pytest.raises(ConfigError, match="optim.warmup_step.*did you mean 'warmup_steps'"):
        load_config(str(path))


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("steps: 3\nmodel: [unclosed\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d"):
        load_config(str(path))


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n "steps": 3,\n}\n')
    with pytest.raises(ConfigError, match="invalid JSON at line 3"):
        load_config(str(path))


def test_all_keys_cover_sections():
    keys = all_keys()
    assert "optim.lr" in keys and "memory.optimizer_in_backward" in keys and "prune.method" in keys


def test_nm_pattern_is_not_a_base60_number(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("prune:\n  method: wanda\n  pattern: 2:4\n")
    assert load_config(str(path)).prune.pattern == "2:4"
    assert load_config(None, ["prune.method=wanda", "prune.pattern=2:4"]).prune.pattern == "2:4"


ORIGINAL = ["prune.method=gradprobe", "prune.decision=original"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([*ORIGINAL, "prune.pattern=2:4"], "use prune.decision=rank for N:M"),
        ([*ORIGINAL, "prune.exact_target=true"], "prune.exact_target=true with prune.decision=original"),
        ([*ORIGINAL, "prune.sequential=false"], "prune.sequential=false with prune.decision=original"),
        ([*ORIGINAL, "prune.group_size=2"], "prune.group_size=2 with prune.decision=original"),
        ([*ORIGINAL, "prune.base=magnitude", "prune.scope=per_matrix"], "whose magnitude candidates are below one global"),
        ([*ORIGINAL, "prune.stat_dtype=bf16"], "prune.stat_dtype=bf16 with prune.decision=original"),
        ([*ORIGINAL, "prune.stat_dtype=fp16"], "prune.stat_dtype=fp16 with prune.decision=original"),
        ([*ORIGINAL, "prune.base=wanda", "prune.scope=global"], "wanda compares weights within an output row"),
        (["prune.method=wanda", "prune.decision=original"], "prune.decision=original is GradProbe's rule"),
        (["prune.method=gradprobe", "prune.decision=veto", "prune.exact_target=false"], "the undershooting veto"),
        (["prune.method=gradprobe", "prune.decision=veto", "prune.exact_target=false"], "veto prunes exactly the target"),
        (
            ["prune.method=gradprobe", "prune.decision=veto", "prune.base=magnitude", "prune.scope=global", "prune.sequential=true"],
            "needs every matrix probed before any is pruned",
        ),
        (["prune.method=wanda", "prune.scope=global"], "wanda compares weights within an output row"),
    ],
)
def test_prune_mode_contradictions_are_refused_before_launch(overrides, message):
    """Each is one line from check_run (what harness.train, harness.prune and the pre-flight run on every rank)."""
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        check_run(cfg, load_strategy("ddp"), 1, False)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ORIGINAL,
        [
            *ORIGINAL,
            "prune.base=magnitude",
            "prune.scope=global",
            "prune.stat_dtype=fp32",
            "prune.exact_target=false",
            "prune.sequential=true",
            "prune.group_size=1",
        ],
        [*ORIGINAL, "prune.base=wanda", "prune.scope=per_matrix"],
        ["prune.method=gradprobe", "prune.decision=veto", "prune.stat_dtype=fp32"],
        ["prune.method=gradprobe", "prune.decision=veto", "prune.base=magnitude", "prune.scope=global"],
        ["prune.method=gradprobe", "prune.decision=veto", "prune.sequential=true"],
    ],
)
def test_prune_modes_accepted(overrides):
    check_run(load_config(None, overrides), load_strategy("ddp"), 1, False)


GRADPROBE = ["prune.method=gradprobe"]
FIT = ["prune.method=sparsegpt_fit"]


def test_gradprobe_decides_by_its_veto_unless_told():
    assert load_config(None, GRADPROBE).prune.decision == "veto"
    check_run(load_config(None, GRADPROBE), load_strategy("ddp"), 1, False)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [*FIT, "prune.base=magnitude"],
            "prune.base=magnitude is read by prune.method=gradprobe only, not prune.method=sparsegpt_fit: set "
            "prune.method=gradprobe to use it, or unset prune.base",
        ),
        (
            [*FIT, "prune.pool=0.5", "prune.threshold=0.2"],
            "prune.pool=0.5, prune.threshold=0.2 are read by prune.method=gradprobe only, not prune.method=sparsegpt_fit: "
            "set prune.method=gradprobe to use them, or unset prune.pool, prune.threshold",
        ),
        (["prune.method=sparsegpt", "prune.group_size=2"], "prune.group_size=2 is read by prune.method=gradprobe only"),
        (["prune.method=wanda", "prune.stat_dtype=fp32"], "prune.stat_dtype=fp32 is read by prune.method=gradprobe only"),
        (["prune.method=sparsegpt", "prune.fit_epochs=2"], "prune.fit_epochs=2 is read by prune.method=sparsegpt_fit only"),
        ([*GRADPROBE, "prune.fit_lr=0.01"], "prune.fit_lr=0.01 is read by prune.method=sparsegpt_fit only"),
        (
            [*FIT, "prune.scope=global"],
            "prune.method=sparsegpt_fit prunes one decoder block after another, each on the pruned blocks' "
            "outputs, per block of columns or N:M, then fits it: unset prune.scope and prune.sequential",
        ),
        (
            [*FIT, "prune.targets=all_linears"],
            "prune.targets=all_linears with prune.method=sparsegpt_fit: it fits one decoder block at a time",
        ),
        ([*GRADPROBE, "prune.decision=reconstruct"], "prune.decision=reconstruct is now prune.method=sparsegpt_fit"),
        ([*FIT, "prune.recon_steps=2"], "config key 'prune.recon_steps' is now prune.fit_epochs"),
    ],
)
def test_keys_the_method_does_not_read_are_refused(overrides, message):
    """A key only another method reads would be ignored: one line from check_run (or the loader,
    for a key that was renamed) naming the method that reads it."""
    with pytest.raises(ConfigError) as err:
        check_run(load_config(None, overrides), load_strategy("ddp"), 1, False)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        # a saved full config: every key written, at its default
        [*FIT, "prune.base=wanda", "prune.pool=0.25", "prune.group_size=0", "prune.threshold=0.0", "prune.fit_epochs=1"],
        [*GRADPROBE, "prune.decision=veto", "prune.base=magnitude", "prune.pool=0.5", "prune.group_size=2", "prune.stat_dtype=fp32"],
        [*FIT, "prune.fit_epochs=2", "prune.fit_lr=1e-4"],
    ],
)
def test_keys_the_method_reads_are_accepted(overrides):
    check_run(load_config(None, overrides), load_strategy("ddp"), 1, False)


def test_a_config_built_in_code_is_refused_by_the_values_it_changes():
    """Nothing says which keys code wrote: a value other than the schema's default counts."""
    from harness.config import PruneConfig, check_method_keys

    with pytest.raises(ConfigError) as err:
        check_method_keys(PruneConfig(method="sparsegpt_fit", base="magnitude"))
    assert str(err.value).startswith("prune.base=magnitude is read by prune.method=gradprobe only")
    check_method_keys(PruneConfig(method="sparsegpt_fit", base="wanda", pool=0.25))
    check_method_keys(PruneConfig(method="gradprobe", decision="veto", base="magnitude"))


@pytest.mark.parametrize(
    ("overrides", "lr", "why"),
    [
        ([], 3e-3, "the preset tiny-llama trained from random init"),
        (["model.name=/models/smollm2-135m"], 2e-5, "a full fine-tune of pretrained weights"),
        (["model.name=/models/smollm2-135m", "lora.enabled=true"], 2e-4, "LoRA adapters"),
        (["lora.enabled=true"], 2e-4, "LoRA adapters"),
    ],
)
def test_the_learning_rate_defaults_by_what_is_trained(overrides, lr, why):
    cfg = load_config(None, overrides)
    assert cfg.optim.lr == lr
    assert default_lr(cfg) == (lr, why)
    assert describe_lr(cfg) == f"lr {lr:g} (optim.lr's default for {why})"


def test_a_learning_rate_the_user_gives_is_kept_and_not_called_a_default():
    cfg = load_config(None, ["model.name=/models/smollm2-135m", "optim.lr=1e-4"])
    assert cfg.optim.lr == 1e-4
    assert describe_lr(cfg) == "lr 0.0001"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.r=8"], "lora.r set but lora.enabled is not: set lora.enabled=true"),
        (["lora.alpha=32", "lora.r=8"], "lora.alpha, lora.r set but lora.enabled is not"),
        (["prune.sparsity=0.3"], "prune.sparsity set but prune.method is not: set prune.method=<magnitude|wanda|sparsegpt|gradprobe>"),
    ],
)
def test_keys_of_a_section_that_is_off_are_refused_naming_the_switch(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_switch_given_off_explicitly_keeps_its_sections_keys():
    """`lora.enabled: false` in a file that keeps its LoRA settings: the user turned it off."""
    assert load_config(None, ["lora.enabled=false", "lora.r=4"]).lora.r == 4
    assert load_config(None, ["prune.method=none", "prune.sparsity=0.3"]).prune.sparsity == 0.3


def test_the_prune_command_refuses_a_key_its_method_does_not_read(tmp_path):
    """`python -m harness.prune` copies the config before its pre-flight: the copy keeps the value, and
    the pre-flight's check refuses it. Milliseconds: no model is read."""
    from harness.prune import command_config

    out = f"output_dir={tmp_path / 'out'}"
    with pytest.raises(ConfigError) as err:
        check_run(command_config(None, [*FIT, "prune.base=magnitude", out]), load_strategy("ddp"), 1, False)
    assert str(err.value).startswith("prune.base=magnitude is read by prune.method=gradprobe only")
    assert command_config(None, [*GRADPROBE, "prune.base=magnitude", out]).prune.base == "magnitude"


def test_the_prune_command_keeps_what_the_user_wrote(tmp_path):
    """Its copy of the config keeps the written keys: a key left out stays one a DeepSpeed file's own
    number may fill (a copy that recorded none would count every key as written)."""
    from harness.prune import command_config

    cfg = command_config(None, [*GRADPROBE, "micro_batch_size=2", f"output_dir={tmp_path / 'out'}"])
    assert is_given(cfg, "micro_batch_size") and is_given(cfg, "prune.method") and is_given(cfg, "steps")
    assert not is_given(cfg, "grad_accum") and not is_given(cfg, "precision")
