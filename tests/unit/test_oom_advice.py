"""The OOM report's advice on long sequences: where the planner finds activations most of the peak,
the long-sequence knobs are among the changes it costs (each planned on tiny Llama, seconds)."""

from __future__ import annotations

from harness.config import load_config, load_strategy
from harness.reliability import oom

LONG = ["model.name=tiny-llama", "micro_batch_size=1", "memory.activation_checkpointing=full", "memory.loss_chunk_size=1024"]


def _changes(cfg, strategy: str, target: str) -> list[str]:
    keys = oom.candidate_changes(cfg, load_strategy(strategy), True, 2, target)
    return [" ".join(f"{k}={v}" for k, v in change) for change in keys]


def test_activations_dominate_a_long_sequence_not_a_short_one() -> None:
    ddp = load_strategy("ddp")
    assert oom.activations_dominate(load_config(None, [*LONG, "data.seq_len=8192"]), 2, "cpu", ddp)
    assert not oom.activations_dominate(load_config(None, [*LONG, "data.seq_len=16"]), 2, "cpu", ddp)


def test_the_long_sequence_knobs_are_offered_where_they_apply() -> None:
    cfg = load_config(None, [*LONG, "data.seq_len=8192", "grad_accum=3"])
    assert oom.candidate_changes(cfg, load_strategy("ddp"), False, 2, "cuda") == [[("strategy", "fsdp")]]
    gpu = _changes(cfg, "ddp", "cuda")
    assert gpu[-3:] == ["memory.tiled_mlp_tokens=4096", "memory.offload_checkpoint_inputs=True", "parallel.sequence=2 grad_accum=6"]
    assert "memory.offload_checkpoint_inputs=True" not in _changes(cfg, "ddp", "cpu")  # one memory: nothing moves
    assert any(c.startswith("parallel.sequence") for c in _changes(cfg, "zero2", "cuda"))  # DeepSpeed's own Ulysses (ALST)
    assert any(c.startswith("parallel.sequence") for c in _changes(cfg, "zero2_offload", "cuda"))  # ALST with offload too
    short = load_config(None, [*LONG, "data.seq_len=4096"])
    assert not any(c.startswith("memory.tiled_mlp") for c in _changes(short, "ddp", "cuda"))  # one tile would be the whole


def test_the_advice_names_sequence_parallelism_when_only_it_fits() -> None:
    cfg = load_config(None, [*LONG, "data.seq_len=8192", "strategy=fsdp", "memory.tiled_mlp_tokens=4096"])
    split = oom.estimate(load_config(None, [*LONG, "data.seq_len=8192", "strategy=fsdp", "memory.tiled_mlp_tokens=4096",
                                            "parallel.sequence=2", "grad_accum=2"]), 2, target="cpu").total  # fmt: skip
    whole = oom.estimate(cfg, 2, target="cpu").total
    assert split < 0.85 * whole
    advice = oom.planner_suggestion(cfg, 2, int(split / 0.89), "cpu")
    assert advice.startswith("parallel.sequence=2 grad_accum=2"), advice
